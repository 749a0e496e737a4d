"""The tensor arithmetic of quantized checkpoint formats, each from its documented layout: a
stored weight and its companions in, the float32 weight out ([..., N, K], the float model's
orientation). engine/model/checkpoint_schemes.py says which function a format's tensors go through;
nothing here reads a config or a file. Every function raises ModelSourceError naming the shape
it expected where a companion does not fit its weight.
"""

from __future__ import annotations

import torch

from llmserve.common.model_config import ModelSourceError
from llmserve.kernels.cpu_wq import FP4_VALUES  # e2m1 (OCP MX FP4): code -> value

# AutoAWQ's GEMM packing puts output column ORDER[i] of each 8 in nibble i of an int32 word;
# column c is therefore nibble REVERSE[c].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _expect(what: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != want:
        raise ModelSourceError(f"{what} has shape {list(got)}: expected {list(want)}")


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 w [..., N, K] = q * scale_inv of its (bn, bk) block; scale_inv [..., ceil(N /
    bn), ceil(K / bk)] (the last row and column of blocks may be partial)."""
    n, k = weight.shape[-2:]
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ModelSourceError(
            f"weight_scale_inv has shape {list(scale_inv.shape)} for a weight "
            f"{list(weight.shape)} in blocks of {list(block)}: expected [..., {want[0]}, {want[1]}]"
        )
    scale = scale_inv.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return weight.float() * scale[..., :n, :k]


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The unsigned `bits`-wide values [..., count] packed densely along the last dimension of
    int32 words [..., ceil(count * bits / 32)], value i at bits (i * bits) % 32 of word
    i * bits // 32 (32 % bits == 0: no value straddles two words), as int32."""
    per_word = 32 // bits
    want = -(-count // per_word)
    if packed.shape[-1] != want:
        raise ModelSourceError(
            f"packed int32 tensor {list(packed.shape)} holds {packed.shape[-1] * per_word} "
            f"{bits}-bit values per row: expected {want} words for {count}"
        )
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    mask = (1 << bits) - 1
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return values.flatten(-2)[..., :count]


def expand_groups(
    table: torch.Tensor, k: int, group_size: int, g_idx: torch.Tensor | None = None
) -> torch.Tensor:
    """A per-group table [..., N, G] widened to [..., N, K]: column k takes group g_idx[k] when
    g_idx is given (GPTQ's act-order), else k // group_size."""
    if g_idx is not None:
        if g_idx.shape != (k,) or int(g_idx.max()) >= table.shape[-1] or int(g_idx.min()) < 0:
            raise ModelSourceError(
                f"g_idx {list(g_idx.shape)} (groups {int(g_idx.min())}..{int(g_idx.max())}) "
                f"does not map {k} columns into {table.shape[-1]} groups"
            )
        return table[..., g_idx.long()]
    return table.repeat_interleave(group_size, dim=-1)[..., :k]


def dequantize_ct(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    strategy: str,
    size: tuple[int, int],
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors' w = (q - zero_point) * scale, q [..., N, K] (signed integers or
    float8), scale and zero_point by strategy: tensor [1], channel [..., N, 1], group [..., N,
    ceil(K / g)] (size (1, g); g_idx: act-order), block [..., ceil(N / bn), ceil(K / bk)]
    (size (bn, bk))."""
    *lead, n, k = q.shape
    bn, bk = size
    want = {
        "tensor": (1,),
        "channel": (*lead, n, 1),
        "group": (*lead, n, -(-k // bk)),
        "block": (*lead, -(-n // bn), -(-k // bk)),
    }[strategy]
    if strategy == "tensor" and scale.numel() == 1:
        scale = scale.reshape(1)
    _expect(f"weight_scale ({strategy})", scale.shape, want)
    if zero_point is not None:
        _expect(f"weight_zero_point ({strategy})", zero_point.shape, want)
    w = q.float()
    tables = [t.float() for t in (scale, zero_point) if t is not None]
    if strategy == "group":
        tables = [expand_groups(t, k, bk, g_idx) for t in tables]
    elif strategy == "block":
        tables = [
            t.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
            for t in tables
        ]
    if zero_point is not None:
        w = w - tables[1]
    return w * tables[0]


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group_size: int,
    zero_offset: int,
) -> torch.Tensor:
    """GPTQ (AutoGPTQ / GPTQModel): qweight int32 [K * bits / 32, N] packs input rows (row k in
    word k // (32 / bits), bits (k % (32 / bits)) * bits); qzeros int32 [G, N * bits / 32] packs
    output columns alike; scales [G, N]; g_idx [K] (act-order), else k // group_size.
    w[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + zero_offset)), g = g_idx[k]; zero_offset is 1
    for the original format (`gptq`, zeros stored less one), 0 for `gptq_v2`. float32 [N, K]."""
    k = qweight.shape[0] * (32 // bits)
    num_groups, n = scales.shape
    q = unpack_int32(qweight.t(), bits, k)  # [N, K]
    _expect("qzeros", qzeros.shape, (num_groups, -(-n // (32 // bits))))
    zeros = unpack_int32(qzeros, bits, n) + zero_offset  # [G, N]
    if g_idx is None and num_groups != -(-k // group_size):
        raise ModelSourceError(
            f"scales has {num_groups} groups for {k} input rows in groups of {group_size}"
        )
    scale = expand_groups(scales.t().float(), k, group_size, g_idx)  # [N, K]
    zero = expand_groups(zeros.t().float(), k, group_size, g_idx)
    return (q.float() - zero) * scale


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AWQ GEMM (AutoAWQ, 4 bits): qweight int32 [K, N / 8] packs 8 output columns per word in
    AWQ's interleaved order, qzeros int32 [K / g, N / 8] alike, scales [K / g, N];
    w[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]. float32 [N, K]."""
    k, words = qweight.shape
    n = scales.shape[1]
    _expect("scales", scales.shape, (-(-k // group_size), words * 8))
    _expect("qzeros", qzeros.shape, (scales.shape[0], words))
    scale = expand_groups(scales.t().float(), k, group_size)  # [N, K]
    zero = expand_groups(awq_columns(qzeros, n).t().float(), k, group_size)
    return (awq_columns(qweight, n).t().float() - zero) * scale


def awq_columns(packed: torch.Tensor, n: int) -> torch.Tensor:
    """AWQ's int32 [R, N / 8] words unpacked to the 4-bit values [R, N] in column order."""
    nibbles = unpack_int32(packed, 4, packed.shape[-1] * 8).unflatten(-1, (-1, 8))
    return nibbles[..., torch.tensor(AWQ_REVERSE_ORDER)].flatten(-2)[..., :n]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MX FP4 (gpt-oss): blocks uint8 [..., G, 16], two e2m1 values a byte (low nibble
    first), scales uint8 [..., G] e8m0 (2^(s - 127)) for each 32 values; float32 [..., G * 32]."""
    _expect("mxfp4 scales", scales.shape, tuple(blocks.shape[:-1]))
    lut = torch.tensor(FP4_VALUES)
    raw = blocks.to(torch.uint8)
    values = torch.stack((lut[(raw & 0x0F).long()], lut[(raw >> 4).long()]), dim=-1).flatten(-2)
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2)
