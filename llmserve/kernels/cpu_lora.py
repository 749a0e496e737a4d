"""Our batch-invariant CPU LoRA kernel (kernels/cpu_lora.cpp), built at first use and cached
(kernels/cpu_build.py). `lora_rows` adds each adapted row's update in place, computed alone in a
fixed order, so a row's result does not depend on the other rows of the step; its twin in plain
torch is kernels/lora_reference.py's `lora_segments` (the same sums, in BLAS's order).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from llmserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_lora.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")


@functools.cache
def _module() -> Any:
    return cpu_build.load_extension("llmserve_cpu_lora", [SOURCE], CFLAGS)


def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can; it is built on the first call)."""
    return cpu_build.why_unavailable("LoRA kernel", _module)


def lora_rows(
    x: torch.Tensor,
    out: torch.Tensor,
    slot_ids: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    columns: list[int],
    rank: int,
) -> torch.Tensor:
    """out[t, columns[p]:...] += B_p[s] (A_p[s] x[t]) for each row t with slot_ids[t] = s >= 0
    (stack indices, int32), each part p; x [T, in], out [T, out] float32, a [S, R, P, in], b P
    tensors [S, R, out_p]; the first `rank` ranks. Returns out, updated in place."""
    _module().lora_rows(x.contiguous(), out, slot_ids, a, b, columns, rank)
    return out
