"""GPU checks: every kernel of kernels/cuda.py against kernels/reference.py (run in float32 or
float64) on fresh random data. Pools start NaN-filled and only the slots a sequence owns get
values, so a read past a sequence's end shows; outputs start NaN-filled, so an element the kernel
fails to write shows; NaN never passes. Tolerance: per-token relative error (L2 over heads x
head_dim) <= 1e-2 for bf16, 5e-3 for fp16.

FP8 KV pools (torch.float8_e4m3fn, with k_scale / v_scale): the same attention checks against
the reference over the same pool dequantized (same tolerances: they measure the kernels'
arithmetic), the store and the load exactly on every value through the sm_89+ cvt instructions
(which the CPU emulator does not run), and one end-to-end bound on the quantization error.

Marked `gpu`: tests/conftest.py skips them without CUDA, and they skip without CuPy.
Sized to run in well under 2 minutes on an H200, NVRTC compilation included.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from types import ModuleType

import pytest
import torch

from llmserve.kernels import reference as ref
from tests.kernel_checks import (
    FP8,
    assert_close,
    check_fp8_load_exact,
    check_rms_norm,
    check_silu_and_mul,
    check_store_kv_fp8_every_value,
    make_pool,
    nan_like,
    reference_attention,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
FP8_SCALES = (0.5, 0.25)  # k_scale, v_scale of the FP8 pools: K / 0.5, V / 0.25 are stored


@pytest.fixture(scope="module")
def kc() -> ModuleType:
    pytest.importorskip("cupy")
    import llmserve.kernels.cuda as kcuda

    if not kcuda.is_available():
        pytest.skip("kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return kcuda


@pytest.fixture(autouse=True)
def _seed(request: pytest.FixtureRequest) -> None:
    seed = zlib.crc32(request.node.name.encode())
    torch.manual_seed(seed)
    random.seed(seed)


def ragged(num: int, low: int, high: int, block_size: int) -> list[int]:
    """Random lengths in [low, high] with the block edge cases mixed in."""
    edges = [low, high, block_size, block_size + 1, block_size - 1, 2 * block_size, 1]
    lens = [random.randint(low, high) for _ in range(num)]
    for i, e in enumerate(edges[: max(0, num // 2)]):
        lens[i] = min(max(e, low), high)
    random.shuffle(lens)
    return lens


# ---------------------------------------------------------------------------------------------
# Decode


def run_decode(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    seq_lens: Sequence[int],
    num_kv_heads: int = 2,
    num_splits: int | None = None,
    precision: torch.dtype = torch.float64,
    fp8: bool = False,
) -> float:
    """fp8: an FP8 pool with FP8_SCALES, else one of q's dtype."""
    cache_dtype, (k_scale, v_scale) = (FP8, FP8_SCALES) if fp8 else (dtype, (1.0, 1.0))
    k, v, tables = make_pool(
        seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, device=DEVICE,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    num_seqs, num_heads = len(seq_lens), num_kv_heads * group
    q = torch.randn(num_seqs, num_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = nan_like(q)
    kc.paged_decode_attention(
        q, k, v, tables, lens, head_dim**-0.5, k_scale, v_scale, num_splits=num_splits, out=out
    )
    expect = reference_attention(
        q, k, v, tables, seq_lens, range(num_seqs + 1), precision, k_scale, v_scale
    ).to(out.device)
    what = (
        f"decode {dtype} cache {cache_dtype} d{head_dim} bs{block_size} g{group} B{num_seqs} "
        f"splits={num_splits}"
    )
    return assert_close(out, expect, dtype, what)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_grid(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, block_size: int, group: int
) -> None:
    lens = ragged(9, 1, 700, block_size)
    run_decode(kc, dtype, head_dim, block_size, group, lens)  # split-K chosen for a small batch
    run_decode(kc, dtype, head_dim, block_size, group, lens, num_splits=1)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "group", "num_seqs", "low", "high"),
    [
        (torch.bfloat16, 128, 16, 4, 256, 1, 2048),  # large ragged batch
        (torch.float16, 64, 32, 4, 64, 1, 4096),
        (torch.float16, 128, 32, 8, 4, 20000, 32768),  # long contexts, split-K
        (torch.bfloat16, 64, 16, 1, 2, 30000, 32768),  # MHA, long
        (torch.bfloat16, 128, 16, 8, 1, 32768, 32768),  # batch 1 at 32k
    ],
)
def test_decode_large(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    num_seqs: int,
    low: int,
    high: int,
) -> None:
    lens = ragged(num_seqs, low, high, block_size)
    run_decode(kc, dtype, head_dim, block_size, group, lens, precision=torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 33, 300])
def test_decode_split_counts(kc: ModuleType, num_splits: int) -> None:
    """Any split count, including more splits than a sequence has 16-token tiles."""
    lens = [1, 15, 16, 17, 300, 2049, 5000]
    run_decode(kc, torch.bfloat16, 128, 16, 4, lens, num_splits=num_splits)


def test_decode_odd_groups_and_empty_sequences(kc: ModuleType) -> None:
    run_decode(kc, torch.float16, 64, 16, 3, ragged(5, 1, 300, 16), num_kv_heads=3)  # 9 / 3
    run_decode(kc, torch.bfloat16, 128, 16, 20, ragged(3, 1, 500, 16), num_kv_heads=1)  # 2 tiles
    k, v, tables = make_pool([0, 40], 16, 2, 128, torch.bfloat16, device=DEVICE)
    q = torch.randn(2, 4, 128, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out = kc.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=splits)
        assert bool((out[0] == 0).all()), "seq_len 0 must give zeros"
        assert bool(torch.isfinite(out[1]).all())


def test_decode_cuda_graph(kc: ModuleType) -> None:
    """Captured on a side stream with fixed max_seq_len / num_splits, replayed on new queries."""
    lens = ragged(8, 1, 3000, 16)
    k, v, tables = make_pool(lens, 16, 2, 128, torch.bfloat16, device=DEVICE)
    q = torch.randn(8, 8, 128, device=DEVICE).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)

    def step() -> None:
        kc.paged_decode_attention(
            q, k, v, tables, seq_lens, 128**-0.5, max_seq_len=4096, num_splits=7, out=out
        )

    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    q.copy_(torch.randn_like(q, dtype=torch.float32).to(q.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    expect = reference_attention(q, k, v, tables, lens, range(9), torch.float32)
    assert_close(out, expect, torch.bfloat16, "decode replayed from a CUDA graph")


# ---------------------------------------------------------------------------------------------
# Prefill (and mixed batches through paged_attention)


def run_prefill(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    chunks: Sequence[tuple[int, int]],
    num_kv_heads: int = 2,
    block_m: int | None = None,
    precision: torch.dtype = torch.float64,
    entry: str = "prefill",
    fp8: bool = False,
) -> float:
    """chunks: (new tokens, context already in the pool) per sequence. fp8: as run_decode."""
    seq_lens = [n + c for n, c in chunks]
    cache_dtype, (k_scale, v_scale) = (FP8, FP8_SCALES) if fp8 else (dtype, (1.0, 1.0))
    k, v, tables = make_pool(
        seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, device=DEVICE,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    cu = [0]
    for n, _ in chunks:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    out = nan_like(q)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    args = (q, k, v, tables, lens_t, cu_t, scale, k_scale, v_scale)
    if entry == "prefill":
        kwargs = {} if block_m is None else {"block_m": block_m}
        kc.paged_prefill_attention(*args, out=out, **kwargs)
    else:
        kc.paged_attention(*args, out=out)
    expect = reference_attention(q, k, v, tables, seq_lens, cu, precision, k_scale, v_scale)
    what = (
        f"prefill {dtype} cache {cache_dtype} d{head_dim} bs{block_size} g{group} bm{block_m} "
        f"chunks={chunks[:4]}"
    )
    return assert_close(out, expect.to(out.device), dtype, what)


SMALL_CHUNKS = [(1, 40), (37, 0), (64, 100), (130, 17), (5, 3)]


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_grid(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, block_size: int, group: int, block_m: int
) -> None:
    chunks = SMALL_CHUNKS[:]
    random.shuffle(chunks)
    run_prefill(kc, dtype, head_dim, block_size, group, chunks, block_m=block_m)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "group", "chunks"),
    [
        (torch.bfloat16, 128, 16, 4, [(4096, 0)]),  # a 4k causal chunk
        (torch.float16, 128, 32, 4, [(4096, 4096)]),  # a chunk after 4k of context
        (torch.bfloat16, 64, 16, 8, [(700, 3000), (1, 7999), (1000, 0), (333, 333)]),
        (torch.float16, 64, 32, 3, [(257, 31), (512, 1024)]),  # group 3
    ],
)
def test_prefill_large(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    chunks: list[tuple[int, int]],
) -> None:
    for block_m in (64, 128):
        run_prefill(
            kc, dtype, head_dim, block_size, group, chunks, block_m=block_m,
            precision=torch.float32,
        )  # fmt: skip


def test_paged_attention_mixed_batch(kc: ModuleType) -> None:
    """Decode rows and prefill chunks in one flattened batch, as the engine schedules them."""
    chunks = [(1, random.randint(1, 2000)) for _ in range(40)] + [(900, 0), (300, 1200)]
    random.shuffle(chunks)
    run_prefill(kc, torch.bfloat16, 128, 16, 4, chunks, precision=torch.float32, entry="paged")
    decodes = [(1, random.randint(1, 3000)) for _ in range(33)]
    run_prefill(kc, torch.float16, 128, 16, 4, decodes, precision=torch.float32, entry="paged")


# ---------------------------------------------------------------------------------------------
# FP8 KV pools


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_fp8_grid(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, block_size: int, group: int
) -> None:
    lens = ragged(9, 1, 700, block_size)
    run_decode(kc, dtype, head_dim, block_size, group, lens, fp8=True)
    run_decode(kc, dtype, head_dim, block_size, group, lens, num_splits=1, fp8=True)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "group", "num_seqs", "low", "high"),
    [
        (torch.bfloat16, 128, 16, 4, 256, 1, 2048),  # large ragged batch
        (torch.float16, 128, 32, 8, 4, 20000, 32768),  # long contexts, split-K
        (torch.bfloat16, 64, 16, 20, 3, 1, 500),  # GQA 20: two head tiles
    ],
)
def test_decode_fp8_large(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    num_seqs: int,
    low: int,
    high: int,
) -> None:
    lens = ragged(num_seqs, low, high, block_size)
    num_kv_heads = 1 if group == 20 else 2
    run_decode(
        kc, dtype, head_dim, block_size, group, lens, num_kv_heads=num_kv_heads,
        precision=torch.float32, fp8=True,
    )  # fmt: skip


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_fp8_grid(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, group: int, block_m: int
) -> None:
    chunks = SMALL_CHUNKS[:]
    random.shuffle(chunks)
    run_prefill(kc, dtype, head_dim, 16, group, chunks, block_m=block_m, fp8=True)


def test_prefill_fp8_large_and_mixed(kc: ModuleType) -> None:
    for block_m in (64, 128):
        run_prefill(
            kc, torch.bfloat16, 128, 16, 4, [(4096, 4096)], block_m=block_m,
            precision=torch.float32, fp8=True,
        )  # fmt: skip
    chunks = [(1, random.randint(1, 2000)) for _ in range(40)] + [(900, 0), (300, 1200)]
    random.shuffle(chunks)
    run_prefill(
        kc, torch.float16, 128, 16, 4, chunks, precision=torch.float32, entry="paged", fp8=True
    )


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize(
    ("dtype", "index_dtype"), [(torch.float16, torch.int32), (torch.bfloat16, torch.int64)]
)
def test_store_kv_fp8_every_value(
    kc: ModuleType, dtype: torch.dtype, index_dtype: torch.dtype, scale: float
) -> None:
    """cvt.rn.satfinite.e4m3x2.f32 against reference.store_kv (torch's rounding), bytewise."""
    check_store_kv_fp8_every_value(kc, dtype, index_dtype, scale, device=DEVICE)


@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_load_is_exact_for_every_value(kc: ModuleType, dtype: torch.dtype, entry: str) -> None:
    """cvt.rn.f16x2.e4m3x2 (and on to bf16) gives every FP8 value exactly."""
    check_fp8_load_exact(kc, dtype, entry, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_pool_end_to_end(kc: ModuleType, dtype: torch.dtype) -> None:
    """The engine's path: K / V of q's dtype stored by the kernel into an FP8 pool, then decode
    and prefill over it, against float32 attention over the unquantized K / V. E4M3 rounds each
    element by up to 2^-4 relative (2.7% RMS on normal data, as
    tests/kernels/test_kernels_reference.py measures; attention carries about that to its output); a
    token row here is 32 heads x 128
    dims, so its error stays near that RMS: bound 8%."""
    num_kv_heads, group, head_dim, block_size = 8, 4, 128, 16
    chunks = [(1, 700), (1, 33), (250, 0), (40, 300)]  # two decodes, two prefill chunks
    seq_lens = [n + c for n, c in chunks]
    cu = [0]
    for n, _ in chunks:
        cu.append(cu[-1] + n)
    k_scale, v_scale = 4.0 / 448, 3.0 / 448  # K up to +-4, V up to +-3 fill E4M3's range
    key = torch.randn(sum(seq_lens), num_kv_heads, head_dim, device=DEVICE).clamp(-4, 4)
    value = (torch.randn_like(key) * 0.75).clamp(-3, 3)
    need = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(need) + 3).tolist()
    tables = torch.zeros(len(chunks), max(need), dtype=torch.int32)
    slots, at = [], 0
    for b, n in enumerate(seq_lens):
        tables[b, : need[b]] = torch.tensor(perm[at : at + need[b]])
        at += need[b]
        slots.append(
            (tables[b, : need[b], None] * block_size + torch.arange(block_size)).flatten()[:n]
        )
    shape = (sum(need) + 3, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=FP8, device=DEVICE)
    v_cache = torch.full(shape, float("nan"), dtype=FP8, device=DEVICE)
    slot_mapping = torch.cat(slots).to(DEVICE)
    kc.store_kv(key.to(dtype), value.to(dtype), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    tables = tables.to(DEVICE)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = kc.paged_attention(q, k_cache, v_cache, tables, lens_t, cu_t, scale, k_scale, v_scale)
    # and the decode kernel on the two decodes alone (rows 0 and 1 of q)
    out[:2] = kc.paged_decode_attention(
        q[:2], k_cache, v_cache, tables[:2], lens_t[:2], scale, k_scale, v_scale
    )
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    for b in range(len(chunks)):
        # dense attention: the request's whole context as one block of a pool of its own
        kb = key[starts[b] : starts[b + 1]].view(1, -1, num_kv_heads, head_dim)
        vb = value[starts[b] : starts[b + 1]].view(1, -1, num_kv_heads, head_dim)
        table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
        qb = q[cu[b] : cu[b + 1]].float()
        dense = reference_attention(
            qb, kb, vb, table, [seq_lens[b]], [0, cu[b + 1] - cu[b]], torch.float32
        )
        err = (out[cu[b] : cu[b + 1]].float() - dense).flatten(1).norm(dim=1)
        err = err / dense.flatten(1).norm(dim=1)
        assert float(err.max()) <= 0.08, f"fp8 pool, {dtype}, request {b}: {float(err.max()):.3e}"


# ---------------------------------------------------------------------------------------------
# store_kv and the per-token layer ops


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, index_dtype: torch.dtype
) -> None:
    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 3000, 16, 4, 16, 400
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[torch.rand(num_tokens, device=DEVICE) < 0.1] = -1  # padding rows
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=DEVICE).to(dtype)
    v = torch.randn(shape, device=DEVICE).to(dtype)
    k_ref, v_ref = k.clone(), v.clone()
    kc.store_kv(key, value, k, v, slots.to(index_dtype))
    ref.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm(kc: ModuleType, dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    x = (torch.randn(1000, hidden, device=DEVICE) * 3).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    residual = torch.randn(1000, hidden, device=DEVICE).to(dtype) if with_residual else None
    check_rms_norm(kc, x, weight, residual, dtype)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_embedding(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, pos_dtype: torch.dtype
) -> None:
    num_tokens, num_heads, num_kv_heads = 777, 8, 2
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(8192).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided view
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE)
    expect = ref.rotary_embedding(positions, q, cache)
    got = kc.rotary_embedding(positions.to(pos_dtype), q, cache, out=nan_like(expect))
    assert_close(got, expect, dtype, "rotary vs reference")
    exact_x1, exact_x2 = q[..., : head_dim // 2].double(), q[..., head_dim // 2 :].double()
    cos, sin = cache[positions].double().unsqueeze(1).chunk(2, dim=-1)
    exact = torch.cat((exact_x1 * cos - exact_x2 * sin, exact_x2 * cos + exact_x1 * sin), -1)
    assert_close(got, exact, dtype, "rotary vs float64")
    kc.rotary_embedding(positions.to(pos_dtype), q, cache, out=q)  # in place on the view
    assert torch.equal(q, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_and_mul(kc: ModuleType, dtype: torch.dtype) -> None:
    x = (torch.randn(1000, 2 * 1536, device=DEVICE) * 3).to(dtype)
    check_silu_and_mul(kc, x, dtype)


# ---------------------------------------------------------------------------------------------
# Weight-only int8 linear (int8_gemm.cu)

INT8_SHAPES = {"q/o": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096),
               "down": (4096, 14336)}  # fmt: skip


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 64, 333])
@pytest.mark.parametrize("shape", list(INT8_SHAPES))
def test_int8_linear_8b_shapes(kc: ModuleType, shape: str, rows: int) -> None:
    """Every GEMV instance (1-8 rows) and the GEMM (9+, a partial row tile at 333) on the 8B
    linear shapes, bf16, against the float32 product over the same int8 weights (channels of
    different ranges), into a NaN-filled output."""
    from llmserve.kernels import int8 as ki

    n, k = INT8_SHAPES[shape]
    weight = torch.randn(n, k, device=DEVICE) * torch.rand(n, 1, device=DEVICE)
    q, scales = ref.quantize_int8_per_channel(weight)
    x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    kc.int8_linear(x, ki.pack_weight(q), scales, out=out)
    expect = ref.int8_linear(x.float(), q, scales)
    assert_close(out, expect, torch.bfloat16, f"int8_linear {shape} x {rows}")


@pytest.mark.parametrize("path", ["gemv", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_linear_tails(kc: ModuleType, dtype: torch.dtype, path: str) -> None:
    """Odd N, K a multiple of 16 but not of 32 or 512, both dtypes, both paths forced."""
    from llmserve.kernels import int8 as ki

    n, k = 1001, 4112
    q, scales = ref.quantize_int8_per_channel(torch.randn(n, k, device=DEVICE))
    for rows in (1, 7):
        x = torch.randn(rows, k, device=DEVICE).to(dtype)
        got = kc.int8_linear(x, ki.pack_weight(q), scales, path=path)
        assert_close(got, ref.int8_linear(x.float(), q, scales), dtype, f"{path} x {rows}")


# ---------------------------------------------------------------------------------------------
# Quantized checkpoints' linears (w4a16_gemm.cu, fp8_block_gemm.cu)

QUANT_SHAPES = {"q/o": (4096, 4096), "gate/up": (14336, 4096), "down": (4096, 14336)}


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 333])
@pytest.mark.parametrize("shape", list(QUANT_SHAPES))
def test_w4a16_linear_8b_shapes(kc: ModuleType, shape: str, rows: int, bits: int) -> None:
    """The GEMV instances (1-8 rows, per 8 rows up to 64 / 32 rows for 4 / 8 bits) and
    dequantize + cuBLAS above on the 8B projections, W4A16 and W8A16, group 128, asymmetric
    zeros, act-order, bf16, against the float64 product."""
    from llmserve.kernels import quant_reference as qref
    from llmserve.kernels import w4a16

    n, k = QUANT_SHAPES[shape]
    levels = 2**bits
    q = torch.randint(0, levels, (n, k), device=DEVICE, dtype=torch.int32)
    scale = (torch.rand(n, k // 128, device=DEVICE) * 2e-3 + 1e-3) * 16 / levels
    zero = torch.randint(0, levels, (n, k // 128), device=DEVICE).float()
    perm = torch.randperm(k, device=DEVICE)
    weight = w4a16.pack_w4a16(q, scale, zero, 128, perm, bits=bits)
    x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    kc.w4a16_linear(x, weight, out=out)
    expect = qref.w4a16_linear_reference(x, q, scale, zero, 128, perm)
    assert_close(out, expect, torch.bfloat16, f"w4a16_linear {shape} x {rows}")


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 333])
@pytest.mark.parametrize("shape", list(QUANT_SHAPES))
def test_fp8_block_linear_8b_shapes(kc: ModuleType, shape: str, rows: int) -> None:
    """The GEMV instances and, above 8 rows, torch._scaled_mm (sm_90, x quantized per
    token-group of 128) or dequantize + cuBLAS, 128 x 128 blocks, bf16, against float64."""
    from llmserve.kernels import fp8_block
    from llmserve.kernels import quant_reference as qref

    n, k = QUANT_SHAPES[shape]
    q = (torch.randn(n, k, device=DEVICE) * 100).to(torch.float8_e4m3fn)
    blocks = torch.rand(n // 128, k // 128, device=DEVICE) * 1e-4 + 5e-5
    scale = blocks.repeat_interleave(128, dim=0)
    weight = fp8_block.pack_fp8_block(q, scale, 128)
    x = torch.randn(rows, k, device=DEVICE).to(torch.bfloat16)
    out = torch.full((rows, n), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    kc.fp8_block_linear(x, weight, out=out)
    scaled_mm = rows > 8 and fp8_block.scaled_mm_unsupported(weight, x.device) is None
    expect = qref.fp8_block_linear_reference(x, q, scale, 128, quantize_x=scaled_mm)
    assert_close(out, expect, torch.bfloat16, f"fp8_block_linear {shape} x {rows}")


# ---------------------------------------------------------------------------------------------
# Mixture-of-experts experts (moe.cu)


@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_experts_qwen3_30b_shape(kc: ModuleType, dtype: torch.dtype, tokens: int) -> None:
    """Qwen3-30B-A3B's sparse layer (hidden 2048, 128 experts of width 768, top-8), this rank
    holding experts 32..95 (expert parallelism at T = 4 for rank 1), into a NaN-filled output,
    against kernels/moe_reference.py in float32 over the same rounded inputs; then captured in
    a CUDA graph and replayed on new routing."""
    from llmserve.kernels import moe_reference as moe_ref

    hidden, inter, experts, top_k, first, local = 2048, 768, 128, 8, 32, 64
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w13 = (torch.randn(local, 2 * inter, hidden, device=DEVICE) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(local, hidden, inter, device=DEVICE) * inter**-0.5).to(dtype)
    weights, ids = moe_ref.route(torch.randn(tokens, experts, device=DEVICE), top_k, True)
    out = torch.full((tokens, hidden), float("nan"), device=DEVICE, dtype=dtype)
    kc.moe_experts(x, weights, ids, w13, w2, first, out=out)
    want = moe_ref.moe_experts(x.float(), weights, ids, w13.float(), w2.float(), first)
    mine = ((ids >= first) & (ids < first + local)).any(-1)
    assert not out[~mine].any(), "a token with no local expert must come out zero"
    assert_close(out[mine], want[mine], dtype, "moe_experts vs float32 reference")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kc.moe_experts(x, weights, ids, w13, w2, first, out=out)
    new_weights, new_ids = moe_ref.route(torch.randn(tokens, experts, device=DEVICE), top_k, True)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    want = moe_ref.moe_experts(x.float(), weights, ids, w13.float(), w2.float(), first)
    mine = ((ids >= first) & (ids < first + local)).any(-1)
    assert_close(out[mine], want[mine], dtype, "moe_experts replayed vs float32 reference")


@pytest.mark.parametrize("tokens", [1, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lora_add_8b_qkv_shape(kc: ModuleType, dtype: torch.dtype, tokens: int) -> None:
    """The 8B shape's qkv_proj (in 4096; q 4096, k 1024, v 1024 out) with 8 slots of ranks 8
    and 16 (max rank 16) and a quarter of the rows on the base: the update against
    kernels/lora_reference.py in float32 over the same rounded inputs, base rows untouched;
    then captured in a CUDA graph and replayed with the rows' slots changed."""
    from llmserve.kernels import lora_reference as lora_ref

    widths, slots, in_features = [4096, 1024, 1024], 8, 4096
    a = torch.randn(slots, 16, 3, in_features, device=DEVICE) * in_features**-0.5
    b = [torch.randn(slots, 16, w, device=DEVICE) for w in widths]
    a[::2, 8:] = 0  # even slots: rank 8
    for bp in b:
        bp[::2, 8:] = 0
    a, b = a.to(dtype), [bp.to(dtype) for bp in b]
    x = torch.randn(tokens, in_features, device=DEVICE).to(dtype)
    base = torch.randn(tokens, sum(widths), device=DEVICE).to(dtype) * 0.1
    ids = torch.randint(-2, slots, (tokens,), device=DEVICE, dtype=torch.int32)
    ids[0] = 1  # at least one adapted row
    out = base.clone()
    kc.lora_add(x, out, ids, a, b, 16)

    def expect() -> torch.Tensor:
        want = base.float().clone()
        return lora_ref.lora_add(x.float(), want, ids, a.float(), [bp.float() for bp in b], 16)

    adapted = ids >= 0
    assert torch.equal(out[~adapted], base[~adapted]), "base rows must not move"
    assert_close(out[adapted], expect()[adapted], dtype, "lora_add vs float32 reference")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(base)
        kc.lora_add(x, out, ids, a, b, 16)
    ids.copy_(torch.randint(-2, slots, (tokens,), device=DEVICE, dtype=torch.int32))
    ids[0] = 2
    graph.replay()
    adapted = ids >= 0
    assert_close(out[adapted], expect()[adapted], dtype, "lora_add replayed vs float32 reference")
