"""Our CPU int8 kernel (kernels/cpu_int8.cpp), compiled at first use by torch's C++ extension
builder and cached, keyed by its text (kernels/cpu_build.py).

`int8_linear` (on weights packed by `pack_int8`) has a plain-torch twin, `int8_linear_reference`,
the ground truth of its tests and the path where the kernel cannot be built (no AVX2, no
compiler).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_int8.cpp")
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")


def build_dir() -> Path:
    """Where the int8 kernel is built (kernels/cpu_build.py: keyed by its text and flags)."""
    return cpu_build.build_dir([SOURCE], CFLAGS)


@functools.cache
def _module() -> Any:
    return cpu_build.load_extension("llmserve_cpu_int8", [SOURCE], CFLAGS)


def unavailable() -> str | None:
    """Why the CPU int8 kernel cannot run here (None: it can; it is built on the first call)."""
    return cpu_build.why_unavailable("int8 kernel", _module)


TILE_N = 16  # output channels per packed tile (cpu_int8.cpp)


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight in the kernel's layout: q [N' / 16, K, 16], scales and offsets
    [N' / 16, K / group, 16], N' = N rounded up to 16 (the padding rows are zero)."""

    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    out_features: int


def pack_int8(
    q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int
) -> PackedInt8:
    """q [N, K] int8 with scales and offsets [N, K / group] (W = q * scale + offset) packed."""
    n = q.shape[0]
    pad = -n % TILE_N
    if pad:
        q, scales, offsets = (
            torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scales, offsets)
        )

    def tiles(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, TILE_N, t.shape[1]).transpose(1, 2).contiguous()

    return PackedInt8(tiles(q), tiles(scales.float()), tiles(offsets.float()), group, n)


# From this many rows on, the weight is widened into a scratch matrix and multiplied by
# torch's float32 GEMM (measured on a 2-core AVX2 CPU: 1.6-1.8x the micro-kernel's speed at 256
# rows); below, the micro-kernel reads under a third of the bytes (int8 plus a
# scale and an offset per 32 weights).
WIDEN_ROWS = 128
_scratch: dict[tuple[int, int], torch.Tensor] = {}  # one per weight shape, shared by layers


def int8_linear(x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 times W^T (+ bias [N] float32) through kernels/cpu_int8.cpp."""
    n_padded = w.q.shape[0] * TILE_N
    if x.shape[0] >= WIDEN_ROWS:
        shape = (n_padded, w.q.shape[1])
        if shape not in _scratch:
            _scratch[shape] = torch.empty(shape)
        weight = _scratch[shape]
        _module().int8_widen(w.q, w.scales, w.offsets, w.group, weight)
        y = torch.nn.functional.linear(x, weight[: w.out_features], bias)
        return y
    if bias is not None and n_padded != w.out_features:
        bias = torch.nn.functional.pad(bias, (0, n_padded - w.out_features))
    y = _module().int8_linear(x.contiguous(), w.q, w.scales, w.offsets, w.group, bias)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features]


def int8_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The same product in plain torch, from the unpacked q [N, K], scales, offsets [N, K / g]."""
    n, k = q.shape
    grouped = q.view(n, k // group, group).float()
    w = (grouped * scales.view(n, -1, 1) + offsets.view(n, -1, 1)).view(n, k)
    return torch.nn.functional.linear(x.float(), w, bias)
