"""kernels/reference.py in float64: paged attention against dense attention over contiguous K/V,
store_kv, rms_norm, rotary_embedding, silu_and_mul."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from llmserve.kernels import reference as ops

F64 = torch.float64
HEAD_DIM = 8
NUM_KV_HEADS = 2


def dense_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Textbook attention for one sequence, for checking the paged op: q [Lq, H, D] are the last
    Lq positions of k/v [L, Hkv, D]. Explicit softmax, no fused kernels."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    visible = torch.arange(seq_len)[None, :] <= q_pos
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Case:
    """A batch of requests: context_lens[b] tokens in the pool before the step, num_q[b] now."""

    context_lens: list[int]
    num_q: list[int]


def build_batch(
    case: Case, block_size: int, group: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int], list]:
    """Random q/k/v for every request, K/V written through store_kv to shuffled blocks of a pool
    that also holds other garbage. Returns (q, k_cache, v_cache, block_tables, seq_lens,
    cu_seqlens_q, per-request (q, k, v) contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_heads = NUM_KV_HEADS * group
    seq_lens = [c + n for c, n in zip(case.context_lens, case.num_q, strict=True)]
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    block_ids = list(range(num_blocks))
    rng.shuffle(block_ids)
    # the pool starts as garbage that must never be read (finite, so a leak shows as a mismatch)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, dtype=F64) * 100
    v_cache = torch.randn(shape, generator=gen, dtype=F64) * 100
    max_blocks = max(blocks_needed) + 2
    tables: list[list[int]] = []
    per_request = []
    qs = []
    for b, seq_len in enumerate(seq_lens):
        table = [block_ids.pop() for _ in range(blocks_needed[b])]
        # padding entries may hold any valid block id
        tables.append(table + [rng.randrange(num_blocks) for _ in range(max_blocks - len(table))])
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=F64)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=F64)
        q = torch.randn(case.num_q[b], num_heads, HEAD_DIM, generator=gen, dtype=F64)
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        )
        ops.store_kv(k, v, k_cache, v_cache, slots)
        per_request.append((q, k, v))
        qs.append(q)
    cu = [0]
    for n in case.num_q:
        cu.append(cu[-1] + n)
    return (
        torch.cat(qs),
        k_cache,
        v_cache,
        torch.tensor(tables),
        seq_lens,
        cu,
        per_request,
    )


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch SDPA over contiguous K/V with an explicit bottom-right causal mask."""
    num_q, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    qq = q.transpose(0, 1)
    mask = torch.ones(num_q, seq_len, dtype=torch.bool).tril(diagonal=seq_len - num_q)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1)


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Per query, per head loops: the plainest possible statement of causal GQA attention."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(num_q):
        pos = seq_len - num_q + i
        for h in range(num_heads):
            kh = k[: pos + 1, h // group]
            w = torch.softmax(kh @ q[i, h] * scale, dim=0)
            out[i, h] = w @ v[: pos + 1, h // group]
    return out


def _grid() -> list[tuple[str, Case, int, int]]:
    cases = {
        "one-decode": Case([0], [1]),
        "one-decode-long": Case([199], [1]),
        "one-prefill": Case([0], [37]),
        "chunk-after-context": Case([50], [13]),
        "decodes": Case([5, 16, 1, 120, 31, 64, 7, 199], [1] * 8),
        "prefills": Case([0, 0, 0], [1 + 16, 16, 9]),
        "mixed": Case([0, 17, 3, 100, 0, 64, 15, 150], [40, 1, 1, 7, 1, 1, 2, 50]),
        "mixed-small": Case([7, 0, 33], [1, 200, 16]),
    }
    grid = []
    for name, case in cases.items():
        for block_size in (8, 16):
            for group in (1, 2, 4):
                grid.append((name, case, block_size, group))
    return grid


GRID = _grid()


@pytest.mark.parametrize(
    ("name", "case", "block_size", "group"),
    GRID,
    ids=[f"{n}-bs{bs}-g{g}" for n, _, bs, g in GRID],
)
def test_paged_attention_matches_dense(name: str, case: Case, block_size: int, group: int) -> None:
    seed = [n for n, *_ in GRID].index(name) * 100 + block_size * 10 + group
    q, k_cache, v_cache, tables, seq_lens, cu, per_request = build_batch(
        case, block_size, group, seed
    )
    scale = HEAD_DIM**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale)
    assert out.dtype == F64 and out.shape == q.shape
    assert not bool(out.isnan().any())
    for b, (qb, kb, vb) in enumerate(per_request):
        got = out[cu[b] : cu[b + 1]]
        dense = dense_causal_attention(qb, kb, vb, scale)
        torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, sdpa_reference(qb, kb, vb, scale), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_dense_causal_attention_matches_naive_loops(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    for num_q, seq_len in [(1, 1), (1, 9), (5, 5), (4, 11)]:
        q = torch.randn(num_q, NUM_KV_HEADS * group, HEAD_DIM, generator=gen, dtype=F64)
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=F64)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen, dtype=F64)
        expected = naive_attention(q, k, v, 0.3)
        torch.testing.assert_close(dense_causal_attention(q, k, v, 0.3), expected)
        torch.testing.assert_close(sdpa_reference(q, k, v, 0.3), expected)


def test_paged_attention_ignores_the_pool_beyond_seq_len() -> None:
    """Changing slots past each request's context (same blocks, later rows) or the padding
    entries of the block tables changes nothing. (Poison is huge but finite: the pool is zeroed at
    allocation, so slots never written are finite.)"""
    case = Case([3, 0, 20], [1, 5, 1])
    q, k_cache, v_cache, tables, seq_lens, cu, _ = build_batch(case, 8, 2, 1)
    before = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, 0.25)
    for b, seq_len in enumerate(seq_lens):
        block = int(tables[b, (seq_len - 1) // 8])
        row = seq_len % 8
        if row:  # partial last block: poison the rest of it
            k_cache[block, row:] = 1e30
            v_cache[block, row:] = -1e30
        # and the padding entries of the block table
        for j in range(-(-seq_len // 8), tables.shape[1]):
            tables[b, j] = 0 if b else tables[b, j]
    after = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, 0.25)
    assert torch.equal(before, after)


def test_paged_attention_scale_matters() -> None:
    case = Case([10], [3])
    q, k_cache, v_cache, tables, seq_lens, cu, per_request = build_batch(case, 8, 1, 2)
    out = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, 0.7)
    qb, kb, vb = per_request[0]
    torch.testing.assert_close(out, dense_causal_attention(qb, kb, vb, 0.7))
    assert not torch.allclose(out, dense_causal_attention(qb, kb, vb, 0.1))


def test_paged_attention_float32_pool_keeps_q_dtype() -> None:
    case = Case([9, 0], [1, 6])
    q, k_cache, v_cache, tables, seq_lens, cu, per_request = build_batch(case, 16, 2, 3)
    out = ops.paged_attention(
        q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, cu, 0.35
    )
    assert out.dtype == torch.float32
    for b, (qb, kb, vb) in enumerate(per_request):
        torch.testing.assert_close(
            out[cu[b] : cu[b + 1]].double(),
            dense_causal_attention(qb, kb, vb, 0.35),
            rtol=1e-5,
            atol=1e-5,
        )


# ---- store_kv / gather_kv --------------------------------------------------------------------


def test_store_kv_writes_exactly_the_given_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, 4, 2, 3, generator=gen, dtype=F64)
    v_cache = torch.randn(6, 4, 2, 3, generator=gen, dtype=F64)
    k0, v0 = k_cache.clone(), v_cache.clone()
    key = torch.randn(5, 2, 3, generator=gen, dtype=F64)
    value = torch.randn(5, 2, 3, generator=gen, dtype=F64)
    slots = torch.tensor([17, 0, 23, 5, 9])
    ops.store_kv(key, value, k_cache, v_cache, slots)
    ek, ev = k0.view(-1, 2, 3).clone(), v0.view(-1, 2, 3).clone()
    ek[slots] = key
    ev[slots] = value
    assert torch.equal(k_cache.view(-1, 2, 3), ek)
    assert torch.equal(v_cache.view(-1, 2, 3), ev)
    assert torch.equal(k_cache[4, 1], key[0])  # slot 17 = block 4, row 1
    assert torch.equal(v_cache[5, 3], value[2])  # slot 23 = block 5, row 3


def test_store_kv_skips_padding_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(3, 4, 1, 2, generator=gen, dtype=F64)
    v_cache = torch.randn(3, 4, 1, 2, generator=gen, dtype=F64)
    k0, v0 = k_cache.clone(), v_cache.clone()
    key = torch.randn(4, 1, 2, generator=gen, dtype=F64)
    value = torch.randn(4, 1, 2, generator=gen, dtype=F64)
    ops.store_kv(key, value, k_cache, v_cache, torch.tensor([-1, 10, -1, 2]))
    flat_k, flat_v = k_cache.view(12, 2), v_cache.view(12, 2)
    changed = (flat_k != k0.view(12, 2)).any(-1).nonzero().view(-1).tolist()
    assert changed == [2, 10]
    assert (flat_v != v0.view(12, 2)).any(-1).nonzero().view(-1).tolist() == [2, 10]
    assert torch.equal(flat_k[10], key[1, 0]) and torch.equal(flat_k[2], key[3, 0])
    assert torch.equal(flat_v[10], value[1, 0]) and torch.equal(flat_v[2], value[3, 0])
    # in particular the last slot (what -1 would name as a python index) is untouched
    assert torch.equal(flat_k[11], k0.view(12, 2)[11])
    # all padding: nothing changes
    k1, v1 = k_cache.clone(), v_cache.clone()
    ops.store_kv(key, value, k_cache, v_cache, torch.full((4,), -1))
    assert torch.equal(k_cache, k1) and torch.equal(v_cache, v1)


def test_store_kv_casts_to_cache_dtype() -> None:
    k_cache = torch.zeros(2, 2, 1, 2, dtype=torch.float32)
    v_cache = torch.zeros(2, 2, 1, 2, dtype=torch.float32)
    key = torch.tensor([[[1.0 + 1e-12, 2.0]]], dtype=F64)
    ops.store_kv(key, key * 3, k_cache, v_cache, torch.tensor([3]))
    assert k_cache.dtype == torch.float32
    assert k_cache[1, 1, 0].tolist() == [1.0, 2.0]
    assert v_cache[1, 1, 0].tolist() == [3.0, 6.0]


def test_gather_kv_follows_the_block_table() -> None:
    cache = torch.arange(5 * 4, dtype=F64).view(5, 4, 1, 1)
    out = ops.gather_kv(cache, torch.tensor([3, 0, 4, 1]), 10)
    assert out.view(-1).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 16, 17]


# ---- KV cache dtypes: bf16 / fp16 / fp8 pools -------------------------------------------------

FP8 = torch.float8_e4m3fn


def fp8_bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes (torch.equal has no FP8 kernel on the CPU)."""
    return t.view(torch.uint8)


def test_fp8_quantize_rounds_to_nearest_even_and_saturates() -> None:
    x = torch.tensor(
        [0.0, 1.0, 0.3, 1.0625, 1.1875, 447.0, 448.0, 464.0, 1e4, float("inf"), -1e4,
         -float("inf"), 2**-9, 1.5 * 2**-9, 2.5 * 2**-9, 2**-11, 2**-6]
    )  # fmt: skip
    got = ops.quantize_kv(x, FP8).float().tolist()
    # 0.3 -> 1.25 * 2^-2; 1.0625 and 1.1875 are ties between 1 + k/8 values -> even mantissa;
    # 464 is a tie between 448 and 480 (not finite in E4M3): saturates; 1.5 and 2.5 * 2^-9 are
    # subnormal ties -> 2 * 2^-9; 2^-11 underflows to 0.
    assert got == [
        0.0, 1.0, 0.3125, 1.0, 1.25, 448.0, 448.0, 448.0, 448.0, 448.0, -448.0,
        -448.0, 2**-9, 2**-8, 2**-8, 0.0, 2**-6,
    ]  # fmt: skip
    assert bool(ops.quantize_kv(torch.tensor([float("nan")]), FP8).isnan().all())
    # with a scale: x / scale is what is stored, so 300 / 0.5 = 600 saturates to 448
    scaled = ops.quantize_kv(torch.tensor([300.0, 0.3, -0.75]), FP8, 0.5).float().tolist()
    assert scaled == [448.0, 0.625, -1.5]


def test_fp8_quantize_every_bf16_value_matches_torch_after_saturation() -> None:
    """Every finite bf16 value: the same bytes as torch's own conversion of the clamped value
    (round to nearest even), so the rule is torch's plus saturation, nothing home-made."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    got = fp8_bytes(ops.quantize_kv(x, FP8))
    expect = fp8_bytes(x.float().clamp(-448, 448).to(FP8))
    assert torch.equal(got, expect)
    assert int(got.max()) <= 0xFE and not bool(((got & 0x7F) == 0x7F).any())  # never NaN


def test_store_kv_fp8_quantizes_with_scales_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(4)
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8)
    v_cache = torch.zeros(3, 4, 2, 8, dtype=FP8)
    key = torch.randn(4, 2, 8, generator=gen) * 30
    value = torch.randn(4, 2, 8, generator=gen) * 0.01
    key[0, 0, 0] = 1e6  # beyond 448 * k_scale: saturates
    ops.store_kv(key, value, k_cache, v_cache, torch.tensor([5, -1, 11, -1]), 0.25, 2**-10)
    flat_k, flat_v = fp8_bytes(k_cache).view(12, 2, 8), fp8_bytes(v_cache).view(12, 2, 8)
    assert (flat_k != 0).flatten(1).any(-1).nonzero().view(-1).tolist() == [5, 11]
    assert torch.equal(flat_k[11], fp8_bytes(ops.quantize_kv(key[2], FP8, 0.25)))
    assert torch.equal(flat_v[5], fp8_bytes(ops.quantize_kv(value[0], FP8, 2**-10)))
    assert float(k_cache.view(12, 2, 8)[5, 0, 0]) * 0.25 == 448 * 0.25
    # read back: stored * scale is within E4M3's half ulp (2^-4 relative) of what was stored
    back = k_cache.view(12, 2, 8)[11].float() * 0.25
    assert bool(((back - key[2]).abs() <= key[2].abs() * 2**-4 + 2**-9 * 0.25).all())


def test_kv_scales_are_checked() -> None:
    bf16_cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    key = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match=r"k_scale=2\.0 applies only to a float8_e4m3fn cache"):
        ops.store_kv(key, key, bf16_cache, bf16_cache, torch.tensor([0]), 2.0)
    q = torch.zeros(1, 1, 8)
    tables, cu = torch.zeros(1, 1, dtype=torch.long), [0, 1]
    with pytest.raises(ValueError, match=r"v_scale=0\.5 applies only"):
        ops.paged_attention(q, bf16_cache, bf16_cache, tables, [1], cu, 0.1, v_scale=0.5)
    fp8_cache = torch.zeros(2, 4, 1, 8, dtype=FP8)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="must be a finite positive number"):
            ops.paged_attention(q, fp8_cache, fp8_cache, tables, [1], cu, 0.1, k_scale=bad)


def build_batch_in(
    case: Case, cache_dtype: torch.dtype, k_scale: float, v_scale: float, magnitude: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int], list]:
    """build_batch's batch (K, V of std `magnitude`, q float32) stored into a `cache_dtype` pool
    with the given scales; the per-request K/V stay float32 and unquantized."""
    q, k64, v64, tables, seq_lens, cu, per_request = build_batch(case, 16, 2, seed=11)
    k_cache = ops.quantize_kv(k64, cache_dtype, 1.0)  # garbage slots, never read
    v_cache = ops.quantize_kv(v64, cache_dtype, 1.0)
    per_request = [
        (qb.float(), kb.float() * magnitude, vb.float() * magnitude) for qb, kb, vb in per_request
    ]
    for b, (_, kb, vb) in enumerate(per_request):
        slots = torch.tensor([int(tables[b, p // 16]) * 16 + p % 16 for p in range(seq_lens[b])])
        ops.store_kv(kb, vb, k_cache, v_cache, slots, k_scale, v_scale)
    return q.float(), k_cache, v_cache, tables, seq_lens, cu, per_request


# (cache dtype, k_scale, v_scale, K/V magnitude). Rounding to the cache dtype moves each element
# by at most half an ulp, 2^-4 relative for E4M3 (3 mantissa bits), 2^-9 for bf16, 2^-12 for
# fp16; on normal data that is 2.7%, 0.17% and 0.02% RMS (relative L2 over many elements).
# Attention carries about that to its output: V's errors average like V itself, and K's move the
# logits by the same relative amount of q . k * scale.
CACHE_DTYPE_CASES = {
    "fp8": (FP8, 1.0, 1.0, 1.0),
    "fp8-scaled": (FP8, 0.125, 0.0625, 8.0),  # K, V of std 8: 448 * scale is 7 and 3.5 std
    "bf16": (torch.bfloat16, 1.0, 1.0, 1.0),
    "fp16": (torch.float16, 1.0, 1.0, 1.0),
}
# Bounds on (relative L2 error of the whole output, worst row's): about 2x what these cases
# measure (fp8: 0.035 and 0.106, bf16: 0.0022 and 0.0053, fp16: 0.00025 and 0.00067). A row is
# only 2 heads x 8 dims here, so its error scatters widely around the aggregate.
CACHE_DTYPE_TOL = {FP8: (0.08, 0.2), torch.bfloat16: (4e-3, 1e-2), torch.float16: (6e-4, 1.5e-3)}


def relative_errors(
    out: torch.Tensor, per_request: list, cu: list[int], scale: float
) -> tuple[float, float]:
    """(relative L2 error of the whole output, worst token row's) against float32 dense
    attention over the unquantized per-request K/V."""
    dense = torch.cat([dense_causal_attention(qb, kb, vb, scale) for qb, kb, vb in per_request])
    diff = (out.float() - dense).flatten(1)
    rows = diff.norm(dim=1) / dense.flatten(1).norm(dim=1)
    return float(diff.norm() / dense.norm()), float(rows.max())


@pytest.mark.parametrize("name", list(CACHE_DTYPE_CASES))
def test_paged_attention_cache_dtypes_against_float32_dense(name: str) -> None:
    cache_dtype, k_scale, v_scale, magnitude = CACHE_DTYPE_CASES[name]
    case = Case([0, 17, 3, 100, 0, 64, 15, 150], [40, 1, 1, 7, 1, 1, 2, 50])  # "mixed"
    q, k_cache, v_cache, tables, seq_lens, cu, per_request = build_batch_in(
        case, cache_dtype, k_scale, v_scale, magnitude
    )
    scale = HEAD_DIM**-0.5 / magnitude  # logits of the same spread whatever the magnitude
    out = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, scale, k_scale, v_scale)
    assert out.dtype == torch.float32
    total, worst_row = relative_errors(out, per_request, cu, scale)
    tol_total, tol_row = CACHE_DTYPE_TOL[cache_dtype]
    assert total <= tol_total and worst_row <= tol_row, (name, total, worst_row)


@pytest.mark.parametrize("group", [1, 4])
def test_paged_attention_fp8_is_attention_over_the_dequantized_pool(group: int) -> None:
    """In float64, paged attention over an FP8 pool with scales equals dense attention over
    stored * k_scale and stored * v_scale: the scales folded into the logits and the output are
    exact algebra. The rest of the pool holds +-448, finite (the batched decode path multiplies
    masked padding rows by 0), so a leak would show."""
    case = Case([5, 0, 33, 70], [1, 20, 1, 9])
    q, k64, _, tables, seq_lens, cu, per_request = build_batch(case, 16, group, seed=group)
    k_cache = ops.quantize_kv(k64.sign() * 448, FP8)
    v_cache = ops.quantize_kv(-k64.sign() * 448, FP8)
    for b, (_, kb, vb) in enumerate(per_request):
        slots = torch.tensor([int(tables[b, p // 16]) * 16 + p % 16 for p in range(seq_lens[b])])
        ops.store_kv(kb * 3, vb * 0.1, k_cache, v_cache, slots, 0.375, 0.01)
    out = ops.paged_attention(q, k_cache, v_cache, tables, seq_lens, cu, 0.3, 0.375, 0.01)
    assert out.dtype == F64 and not bool(out.isnan().any())
    for b in range(len(seq_lens)):
        k = ops.gather_kv(k_cache, tables[b], seq_lens[b]).double() * 0.375
        v = ops.gather_kv(v_cache, tables[b], seq_lens[b]).double() * 0.01
        got = out[cu[b] : cu[b + 1]]
        dense = dense_causal_attention(q[cu[b] : cu[b + 1]], k, v, 0.3)
        torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-12)


def test_paged_attention_fp8_pool_with_half_precision_queries() -> None:
    """The engine's case: bf16 / fp16 q over an FP8 pool; the output keeps q's dtype and is as
    close to float32 dense attention as the pool's rounding allows (same bound as above, plus
    the half-precision arithmetic, 2^-9 or 2^-12 relative per rounding, far below)."""
    case = Case([0, 17, 3, 100, 0, 64, 15, 150], [40, 1, 1, 7, 1, 1, 2, 50])
    q, k_cache, v_cache, tables, seq_lens, cu, per_request = build_batch_in(
        case, FP8, 0.5, 0.25, 4.0
    )
    for dtype in (torch.bfloat16, torch.float16):
        out = ops.paged_attention(
            q.to(dtype), k_cache, v_cache, tables, seq_lens, cu, HEAD_DIM**-0.5 / 4, 0.5, 0.25
        )
        assert out.dtype == dtype
        total, worst_row = relative_errors(out, per_request, cu, HEAD_DIM**-0.5 / 4)
        assert total <= 0.08 and worst_row <= 0.2, (dtype, total, worst_row)


# ---- rms_norm --------------------------------------------------------------------------------


def rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        rms = math.sqrt(sum(float(v) ** 2 for v in x[i]) / x.shape[1] + eps)
        out[i] = x[i] / rms * weight
    return out


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.5])
def test_rms_norm_without_residual(eps: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=gen, dtype=F64) * 3
    w = torch.randn(24, generator=gen, dtype=F64)
    out, residual = ops.rms_norm(x, w, eps)
    torch.testing.assert_close(out, rms_norm_formula(x, w, eps), rtol=1e-6, atol=1e-6)
    assert torch.equal(residual, x)


def test_rms_norm_with_residual() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, generator=gen, dtype=F64)
    res = torch.randn(4, 16, generator=gen, dtype=F64)
    w = torch.randn(16, generator=gen, dtype=F64)
    x_copy, res_copy = x.clone(), res.clone()
    out, new_residual = ops.rms_norm(x, w, 1e-5, res)
    torch.testing.assert_close(new_residual, x_copy + res_copy, rtol=0, atol=0)
    torch.testing.assert_close(
        out, rms_norm_formula(x_copy + res_copy, w, 1e-5), rtol=1e-6, atol=1e-6
    )
    assert torch.equal(x, x_copy) and torch.equal(res, res_copy)  # inputs untouched


def test_rms_norm_computes_in_float32_for_half_inputs() -> None:
    """As HF's LlamaRMSNorm: normalize in float32, cast to the input dtype, then weight."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 32, generator=gen) * 40).to(torch.bfloat16)
    w = torch.randn(32, generator=gen).to(torch.bfloat16)
    out, _ = ops.rms_norm(x, w, 1e-5)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


# ---- rotary ----------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("head_dim", [2, 8, 64])
def test_rotary_embedding_matches_hf_rotate_half(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    max_pos, num_heads = 300, 3
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=F64) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=F64), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # float64 here, for exactness
    positions = torch.tensor([0, 1, 299, 17, 17, 150])
    x = torch.randn(len(positions), num_heads, head_dim, generator=gen, dtype=F64)
    x[4] = x[3]
    out = ops.rotary_embedding(positions, x, cache.float())
    # HF: emb = cat(freqs, freqs); x * cos + rotate_half(x) * sin
    emb = torch.cat((freqs, freqs), dim=-1)[positions][:, None, :]
    expected = x * emb.cos() + rotate_half(x) * emb.sin()
    assert out.dtype == F64
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[3], out[4]) and not torch.equal(out[0], out[1])
    # position 0 is the identity (up to float32: the rotation is computed in float32)
    assert torch.equal(out[0], x[0].float().double())
    # a rotation preserves each pair's norm
    half = head_dim // 2
    norms = x[..., :half] ** 2 + x[..., half:] ** 2
    rotated = out[..., :half] ** 2 + out[..., half:] ** 2
    torch.testing.assert_close(rotated, norms, rtol=1e-5, atol=1e-5)


# ---- silu_and_mul ----------------------------------------------------------------------------


def test_silu_and_mul() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2 * 12, generator=gen, dtype=F64) * 4
    gate, up = x[:, :12], x[:, 12:]
    expected = gate / (1 + torch.exp(-gate)) * up
    out = ops.silu_and_mul(x)
    assert out.shape == (7, 12)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    # gate first, up second: swapping halves changes the result
    assert not torch.allclose(out, ops.silu_and_mul(torch.cat((up, gate), dim=-1)))


def test_int8_per_channel_quantization_and_packing() -> None:
    """quantize_int8_per_channel: |q| <= 127, each row's largest weight lands on +-127, and the
    error is at most half a step per weight; kernels/int8.py's packing is a permutation within
    groups of 16 that unpack_weight undoes."""
    from llmserve.kernels import int8 as ki

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(37, 64, generator=gen) * torch.rand(37, 1, generator=gen)
    q, scales = ops.quantize_int8_per_channel(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    assert int(q.abs().max()) == 127 and bool((q.abs().amax(dim=1) == 127).all())
    step = scales[:, None]
    assert bool(((q.float() * step - weight).abs() <= step / 2 + 1e-6).all())
    packed = ki.pack_weight(q)
    assert torch.equal(ki.unpack_weight(packed), q)
    assert torch.equal(packed[:, :16], q[:, [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]])
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    want = (x.double() @ (q.double() * scales.double()[:, None]).t()).to(torch.bfloat16)
    got = ops.int8_linear(x, q, scales)  # one rounding to bf16 after float32 sums
    assert got.dtype == torch.bfloat16
    assert bool(((got.float() - want.float()).abs() <= want.float().abs() / 128 + 1e-3).all())
