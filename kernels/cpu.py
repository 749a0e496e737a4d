"""Our CPU kernels (kernels/cpu_int8.cpp), compiled at first use by torch's C++ extension builder
(g++ and ninja) and cached under ~/.cache/llmserve/cpu_kernels (LLMSERVE_KERNEL_CACHE moves it).

`int8_linear` has a plain-torch twin, `int8_linear_reference`, the ground truth of its tests and
the path where the kernel cannot be built (no AVX2, no compiler).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("cpu_int8.cpp")


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "llmserve"
    return Path(root) / "cpu_kernels"


@functools.cache
def _module() -> Any:
    from torch.utils.cpp_extension import load

    build = cache_dir()
    build.mkdir(parents=True, exist_ok=True)
    return load(
        name="llmserve_cpu_int8",
        sources=[str(SOURCE)],
        # OpenMP for at::parallel_for; the libgomp.so.1 it binds to is torch's, already loaded.
        extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(build),
        verbose=False,
    )


def unavailable() -> str | None:
    """Why the CPU int8 kernel cannot run here (None: it can; it is built on the first call)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    try:
        _module()
    except Exception as err:  # no compiler, no ninja, a build error
        return f"the int8 kernel did not build: {type(err).__name__}: {str(err)[:300]}"
    return None


def int8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x [M, K] float32 times W^T (+ bias), W = q * scale + offset: q int8 [N, K], scales and
    offsets float32 [N, K / group], one of each per `group` weights along K."""
    return _module().int8_linear(x.contiguous(), q, scales, offsets, group, bias)


def int8_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    n, k = q.shape
    grouped = q.view(n, k // group, group).float()
    w = (grouped * scales.view(n, -1, 1) + offsets.view(n, -1, 1)).view(n, k)
    return torch.nn.functional.linear(x.float(), w, bias)
