"""Helpers shared by the CUDA kernel tests on the GPU (test_kernels_cuda.py) and on the CPU
emulator (test_kernels_emulated.py): NaN-poisoned paged pools (fp16 / bf16, or FP8 with scales),
the reference, the tolerances.

Tolerances are on the kernel against reference.paged_attention in float64 over the same pool
(an FP8 pool's values dequantized exactly), so they measure the kernel's own arithmetic (P and
the output rounded to q's dtype), not FP8's quantization error: the same bounds hold for every
cache dtype. tests/test_kernels_reference.py bounds the quantization error itself."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import reference as ref

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
