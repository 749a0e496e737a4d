"""Weight-only quantized linear layers on the CPU with the weights kept as quantized checkpoints
ship them (kernels/cpu_wq.cpp, built at first use and cached, keyed by its text:
kernels/cpu_build.py): int8 (W8A16), int4 (W4A16), float8 e4m3 (FP8) and e2m1 (MXFP4, "fp4":
codes 0..15), one float32 scale and offset per `group` weights along K, dequantized in
registers inside the product (AVX2, or AVX-512 where CPUID reports it).

`pack_wq` lays a weight out for the kernel; `wq_linear` runs it; `wq_linear_reference` is its
plain-torch twin (the tests' ground truth, and the path where the kernel cannot be built).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmserve.kernels import cpu_build

SOURCES = [Path(__file__).with_name(n) for n in ("cpu_wq.cpp", "cpu_wq_tile.h")]
# No -mavx2 on the command line: each ISA's code is compiled in its own `#pragma GCC target`
# region, so the library loads on any x86-64 and picks its path by CPUID.
CFLAGS = ("-O3", "-fopenmp")
TILE_N = 16  # output channels per packed tile (cpu_wq.cpp)
KINDS = {"int8": 0, "int4": 1, "fp8": 2, "fp4": 3}
NIBBLE_KINDS = ("int4", "fp4")  # two channels a byte
# e2m1 (OCP MX FP4): code c is sign (bit 3), two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
ISAS = {"auto": 0, "avx2": 1, "avx512": 2}


@functools.cache
def _module() -> Any:
    return cpu_build.load_extension("llmserve_cpu_wq", SOURCES, CFLAGS)


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can; built on the first call)."""
    return cpu_build.why_unavailable("quantized-weight kernel", _module)


def has_avx512() -> bool:
    """Whether the kernel's AVX-512 path can run on this CPU (its code is always compiled)."""
    return bool(_module().wq_has_avx512())


@dataclass(frozen=True)
class PackedWQ:
    """A weight in the kernel's layout: q uint8 [N' / 16, K, 16] (int4, fp4: [N' / 16, K, 8], two
    channels a byte), scales and offsets float32 [N' / 16, ceil(K / group), 16], N' = N rounded up
    to 16 (padding channels are zero)."""

    kind: str
    q: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    out_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets))


def stored_values(
    kind: str, q: torch.Tensor, zero: torch.Tensor | None, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q, zero) moved into the kernel's stored range: int4 unsigned [0, 15], int8 signed
    [-128, 127] (signed 4-bit values shift up by 8, unsigned 8-bit down by 128, the zero point
    alike, made explicit where it was 0, which leaves q - zero unchanged). fp8, fp4 (codes
    0..15): as given."""
    if kind == "fp8":
        return q, zero
    if kind == "fp4":
        if q.dtype != torch.uint8 or int(q.max()) > 15:
            raise ValueError("fp4 weights are e2m1 codes: uint8 values 0..15")
        return q, zero
    low, high = int(q.min()), int(q.max())
    shift = {"int4": 8 if low < 0 else 0, "int8": -128 if high > 127 else 0}[kind]
    span = (0, 15) if kind == "int4" else (-128, 127)
    if not (span[0] <= low + shift and high + shift <= span[1]):
        raise ValueError(f"{kind} values span [{low}, {high}]: not {span[1] - span[0] + 1} levels")
    if shift == 0:
        return q, zero
    zero = torch.zeros(scale.shape) if zero is None else zero.float()
    return q + shift, zero + shift


def pack_wq(
    kind: str, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> PackedWQ:
    """q [N, K] (integers of `kind`'s range, float8_e4m3fn, or fp4's e2m1 codes) with scale and
    zero [N, ceil(K / group)] (w = (value(q) - zero) * scale) in the kernel's layout."""
    n, k = q.shape
    if group <= 0 or tuple(scale.shape) != (n, -(-k // group)):
        raise ValueError(f"scale {list(scale.shape)} for q [{n}, {k}] in groups of {group}")
    q, zero = stored_values(kind, q, zero, scale)
    scale = scale.float()
    offset = torch.zeros_like(scale) if zero is None else -zero.float() * scale
    raw = q.view(torch.uint8) if kind in ("fp8", "fp4") else q.to(torch.int16).to(torch.uint8)
    pad = -n % TILE_N
    if pad:
        pads = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (raw, scale, offset))
        raw, scale, offset = pads

    def tiles(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1, TILE_N, t.shape[1]).transpose(1, 2).contiguous()

    packed = tiles(raw)
    if kind in NIBBLE_KINDS:  # byte j of a k: channel j low nibble, channel j + 8 high
        packed = (packed[..., :8] | (packed[..., 8:] << 4)).contiguous()
    return PackedWQ(kind, packed, tiles(scale), tiles(offset), group, n)


# From this many rows on the weight is widened into a scratch matrix and multiplied by torch's
# float32 GEMM (kernels/cpu.py's WIDEN_ROWS for int8, measured there on this 2-core AVX2 VM).
WIDEN_ROWS = 128
_scratch: dict[tuple[int, int], torch.Tensor] = {}  # one per weight shape, shared by layers


def wq_linear(
    x: torch.Tensor, w: PackedWQ, bias: torch.Tensor | None, isa: str = "auto"
) -> torch.Tensor:
    """x [M, K] float32 times W^T (+ bias [N] float32) through kernels/cpu_wq.cpp."""
    n_padded = w.q.shape[0] * TILE_N
    kind, code = KINDS[w.kind], ISAS[isa]
    if x.shape[0] >= WIDEN_ROWS:
        shape = (n_padded, w.q.shape[1])
        if shape not in _scratch:
            _scratch[shape] = torch.empty(shape)
        weight = _scratch[shape]
        _module().wq_widen(w.q, w.scales, w.offsets, kind, w.group, weight, code)
        return torch.nn.functional.linear(x, weight[: w.out_features], bias)
    if bias is not None and n_padded != w.out_features:
        bias = torch.nn.functional.pad(bias, (0, n_padded - w.out_features))
    y = _module().wq_linear(x.contiguous(), w.q, w.scales, w.offsets, kind, w.group, bias, code)
    return y if y.shape[1] == w.out_features else y[:, : w.out_features]


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 e2m1 values of codes (0..15, any shape)."""
    return torch.tensor(FP4_VALUES)[codes.long()]


def wq_dequantize(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """float32 W [N, K] = (q - zero) * scale, scale and zero per `group` along K (the last
    group may be partial)."""
    k = q.shape[1]
    w = q.float()
    if zero is not None:
        w = w - zero.float().repeat_interleave(group, dim=1)[:, :k]
    return w * scale.float().repeat_interleave(group, dim=1)[:, :k]


def wq_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The same product in plain torch, from the unpacked q [N, K], scale and zero [N, K / g]."""
    return torch.nn.functional.linear(x.float(), wq_dequantize(q, scale, zero, group), bias)
