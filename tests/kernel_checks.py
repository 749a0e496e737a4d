"""Helpers shared by the CUDA kernel tests on the GPU (test_kernels_cuda.py) and on the CPU
emulator (test_kernels_emulated.py): NaN-poisoned paged pools (fp16 / bf16, or FP8 with scales),
the reference, the tolerances.

Tolerances are on the kernel against reference.paged_attention in float64 over the same pool
(an FP8 pool's values dequantized exactly), so they measure the kernel's own arithmetic (P and
the output rounded to q's dtype), not FP8's quantization error: the same bounds hold for every
cache dtype. tests/kernels/test_kernels_reference.py bounds the quantization error itself."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmserve.kernels import reference as ref

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
FP8 = torch.float8_e4m3fn


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def assert_close(out: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype, what: str) -> float:
    """Per-row (first dim) relative L2 error; fails on any NaN or inf in `out`."""
    assert out.shape == expect.shape, (out.shape, expect.shape)
    bad = ~torch.isfinite(out)
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} non-finite outputs (unwritten or NaN)"
    diff = (out.double() - expect.double()).flatten(1).norm(dim=1)
    norm = expect.double().flatten(1).norm(dim=1).clamp_min(1e-30)
    err = float((diff / norm).max())
    assert err <= TOL[dtype], f"{what}: relative error {err:.3e} > {TOL[dtype]}"
    return err


def make_pool(
    seq_lens: Sequence[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    spare_blocks: int = 7,
    device: str = "cpu",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A NaN-filled pool whose sequences own shuffled blocks; each sequence's first seq_len slots
    hold random values (standard normal K / V, stored / k_scale and / v_scale: scales other than
    1 need an FP8 `dtype`). Table rows (int32) are padded with a block id nobody owns."""
    need = [max(1, -(-n // block_size)) for n in seq_lens]
    num_blocks = sum(need) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v = torch.full(shape, float("nan"), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.full((len(seq_lens), max(need)), perm[-1], dtype=torch.int32)
    slots: list[torch.Tensor] = []
    at = 0
    for b, n in enumerate(seq_lens):
        blocks = torch.tensor(perm[at : at + need[b]])
        at += need[b]
        tables[b, : need[b]] = blocks
        slots.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:n])
    index = torch.cat(slots).to(device)
    flat = (-1, num_kv_heads, head_dim)
    rows = (len(index), num_kv_heads, head_dim)
    k.view(flat)[index] = ref.quantize_kv(torch.randn(rows, device=device), dtype, k_scale)
    v.view(flat)[index] = ref.quantize_kv(torch.randn(rows, device=device), dtype, v_scale)
    return k, v, tables.to(device)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: Sequence[int],
    cu_seqlens_q: Sequence[int],
    precision: torch.dtype = torch.float64,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """reference.paged_attention in `precision` on NaN-free copies (slots nobody owns -> 0; the
    reference pads decode contexts with such slots and masks them, and 0 * NaN would be NaN). An
    FP8 pool is dequantized first (stored * scale, exact in float64)."""
    kk = torch.nan_to_num(k.to(precision), nan=0.0) * k_scale
    vv = torch.nan_to_num(v.to(precision), nan=0.0) * v_scale
    scale = q.shape[-1] ** -0.5
    with sdpa_kernel(SDPBackend.MATH):
        return ref.paged_attention(
            q.to(precision), kk, vv, tables.long(), list(seq_lens), list(cu_seqlens_q), scale
        )


def check_rms_norm(
    kc: ModuleType,
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    dtype: torch.dtype,
) -> None:
    """kernels.cuda.rms_norm into poisoned outputs vs the reference and a float64 formula."""
    out = nan_like(x)
    res_out = nan_like(x) if residual is not None else None
    got, got_res = kc.rms_norm(x, weight, 1e-5, residual, out=out, residual_out=res_out)
    expect, expect_res = ref.rms_norm(x, weight, 1e-5, residual)
    assert got is out
    assert torch.equal(got_res, expect_res), "the new residual is x + residual rounded once"
    assert_close(got, expect, dtype, "rms_norm vs reference (same dtype)")
    s = expect_res.double()
    exact = weight.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert_close(got, exact, dtype, "rms_norm vs float64")


def check_silu_and_mul(kc: ModuleType, x: torch.Tensor, dtype: torch.dtype) -> None:
    """kernels.cuda.silu_and_mul into a poisoned output vs the reference and float64."""
    expect = ref.silu_and_mul(x)
    got = kc.silu_and_mul(x, out=nan_like(expect))
    assert_close(got, expect, dtype, "silu_and_mul vs reference")
    gate, up = x.double().chunk(2, dim=-1)
    assert_close(got, gate * torch.sigmoid(gate) * up, dtype, "silu_and_mul vs float64")


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """All 65,536 bit patterns of a 16-bit float type, NaNs removed (their sign is not kept)."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x[~torch.isnan(x)]


def check_store_kv_fp8_every_value(
    kc: ModuleType, dtype: torch.dtype, index_dtype: torch.dtype, scale: float, device: str = "cpu"
) -> None:
    """Every fp16 / bf16 value (infinities, subnormals, ties, beyond +-448 * scale) through the
    quantizing kernels.cuda.store_kv: the same bytes as reference.store_kv. V gets the values
    reversed and twice the scale; every 7th token is a padding row."""
    x = every_value(dtype)
    x = torch.cat((x, x[: -len(x) % 128])).to(device)  # whole rows of 2 heads x 64
    key = x.view(-1, 2, 64)
    value = x.flip(0).view(-1, 2, 64)
    num_tokens = key.shape[0]
    slots = torch.randperm(num_tokens + 40)[:num_tokens].to(device)
    slots[::7] = -1
    shape = (-(-(num_tokens + 40) // 16), 16, 2, 64)
    k = torch.zeros(shape, dtype=FP8, device=device)
    v = torch.zeros(shape, dtype=FP8, device=device)
    k_ref, v_ref = k.clone(), v.clone()
    kc.store_kv(key, value, k, v, slots.to(index_dtype), scale, 2 * scale)
    ref.store_kv(key, value, k_ref, v_ref, slots, scale, 2 * scale)
    assert torch.equal(k.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), v_ref.view(torch.uint8))


def check_fp8_load_exact(
    kc: ModuleType, dtype: torch.dtype, entry: str, device: str = "cpu"
) -> None:
    """Sequences of one token attend to that token alone (softmax weight exactly 1), so the
    output is the token's V row as the kernel converted it: it must equal every finite FP8 value
    exactly, times v_scale (a power of two here, so no rounding). entry: "decode" / "prefill"."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    codes = torch.cat((codes, torch.zeros(256 - len(codes), dtype=torch.uint8)))
    num_seqs, num_kv_heads, head_dim = 2, 2, 64  # 2 x 2 x 64 = 256 slots for 254 values + 2 zeros
    v = torch.zeros(num_seqs, 16, num_kv_heads, head_dim, dtype=FP8)
    v[:, 0] = codes.view(num_seqs, num_kv_heads, head_dim).view(FP8)
    k = ref.quantize_kv(torch.randn(v.shape), FP8)
    k, v = k.to(device), v.to(device)
    tables = torch.arange(num_seqs, dtype=torch.int32, device=device).view(num_seqs, 1)
    q = torch.randn(num_seqs, 3 * num_kv_heads, head_dim, device=device).to(dtype)  # GQA 3
    lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
    if entry == "decode":
        out = kc.paged_decode_attention(q, k, v, tables, lens, 0.1, 1.0, 0.25, num_splits=1)
    else:
        cu = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        out = kc.paged_prefill_attention(q, k, v, tables, lens, cu, 0.1, 1.0, 0.25, block_m=64)
    expect = (v[:, 0].to(torch.float64) * 0.25).repeat_interleave(3, dim=1)
    assert torch.equal(out.to(torch.float64), expect)
