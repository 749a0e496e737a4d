"""A quantized checkpoint weight kept as stored, for the CPU kernels (kernels/cpu_wq.cpp), in
one form every format maps to: `KeptWeight` (q [N, K], a float scale and zero point per `group`
weights along K, w = (q - zero) * scale, and act-order's column permutation). Each format's
scheme (engine/model/checkpoint_schemes.py: `kept`) builds it from the stored tensors; where a
weight does not fit the form (2-bit or 3-D expert weights, an
act-order whose groups are not runs of `group` columns) the scheme returns None and the weight is
dequantized at load instead. engine/model/checkpoint_linear.py serves it (experts:
engine/model/kept_experts.py).

MXFP4 (gpt-oss) is kept as stored, kind "fp4": its e2m1 codes, two a byte, and its e8m0 block
scale 2^(s - 127) as the float32 scale per 32 (exact: a power of two, 2^-127 a subnormal, for
every s in 0..254). (int8 would hold it exactly too, 2 v in [-12, 12] times 2^(s - 128), at
twice the bytes; int4 cannot: the 15 levels 2 v takes are not evenly spaced.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels.cpu_wq import fp4_values, wq_dequantize


@dataclass(frozen=True)
class KeptWeight:
    """kind: "int4" (values in [0, 15] or [-8, 7]), "int8" ([-128, 127] or [0, 255]), "fp8"
    (q float8_e4m3fn) or "fp4" (q uint8 e2m1 codes, 0..15). q [N, K] with its columns in
    `perm` order where act-order reordered them (column j of q is input feature perm[j]);
    scale, zero [N, ceil(K / group)] float32 (zero None: symmetric)."""

    kind: str
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int
    perm: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """float32 W [N, K] in the checkpoint's column order (the tests' cross-check)."""
        q = fp4_values(self.q) if self.kind == "fp4" else self.q
        w = wq_dequantize(q, self.scale, self.zero, self.group)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out


def mxfp4_weights(blocks: torch.Tensor, scales: torch.Tensor) -> list[KeptWeight]:
    """MXFP4 experts blocks uint8 [E, N, G, 16] (low nibble first) and e8m0 scales uint8
    [E, N, G] as E fp4 weights [N, G * 32] (codes) in groups of 32, one expert at a time."""
    kept = []
    for raw, exponent in zip(blocks.to(torch.uint8), scales.to(torch.int32), strict=True):
        codes = torch.stack((raw & 0x0F, raw >> 4), dim=-1).flatten(-3)
        scale = torch.ldexp(torch.ones(exponent.shape), exponent - 127)
        kept.append(KeptWeight("fp4", codes, scale, None, 32))
    return kept


def int_kind(bits: int) -> str | None:
    """The stored kind of `bits`-bit integers (None: wider than 8)."""
    return "int4" if bits <= 4 else "int8" if bits <= 8 else None


def act_order(g_idx: torch.Tensor | None, group: int, k: int) -> tuple[bool, torch.Tensor | None]:
    """(fits, perm): the column order that makes act-order's groups (column c in group
    g_idx[c]) contiguous runs of `group` columns, None where they already are; fits False when
    no order does (a group of another size), and the weight stays dequantized."""
    plain = torch.arange(k) // group
    if g_idx is None:
        return True, None
    groups = g_idx.long()
    if groups.shape != (k,):
        return False, None
    if torch.equal(groups, plain):
        return True, None
    perm = torch.argsort(groups, stable=True)
    return bool(torch.equal(groups[perm], plain)), perm


def int_weight(
    bits: int,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    g_idx: torch.Tensor | None = None,
) -> KeptWeight | None:
    """An integer weight q [N, K] with scale and zero [N, ceil(K / group)] kept (None where it
    does not fit: see the module's docstring)."""
    kind = int_kind(bits)
    n, k = q.shape[-2:]
    if kind is None or q.dim() != 2 or tuple(scale.shape) != (n, -(-k // group)):
        return None
    if zero is not None and zero.shape != scale.shape:
        return None
    fits, perm = act_order(g_idx, group, k)
    if not fits:
        return None
    q = q.to(torch.int32)
    zero = None if zero is None else zero.float()
    return KeptWeight(kind, q if perm is None else q[:, perm], scale.float(), zero, group, perm)


def fp8_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> KeptWeight | None:
    """A float8 e4m3 weight q [N, K] with one scale per (bn, bk) block, [ceil(N / bn), ceil(K /
    bk)] (a channel's: (1, K); the tensor's: one scale and (N, K)) kept, group bk along K."""
    n, k = q.shape[-2:]
    bn, bk = block
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        return None
    if scale.numel() == 1:
        scale = scale.reshape(1, 1)
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        return None
    rows = scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()
    return KeptWeight("fp8", q, rows, None, bk)
