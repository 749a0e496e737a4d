"""GPU checks: every kernel of kernels/cuda.py against kernels/reference.py (run in float32 or
float64) on fresh random data. Pools start NaN-filled and only the slots a sequence owns get
values, so a read past a sequence's end shows; outputs start NaN-filled, so an element the kernel
fails to write shows; NaN never passes. Tolerance: per-token relative error (L2 over heads x
head_dim) <= 1e-2 for bf16, 5e-3 for fp16.

Marked `gpu`: tests/conftest.py skips them without CUDA, and they skip without CuPy.
Sized to run in well under 2 minutes on an H200, NVRTC compilation included.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import pytest
import torch

from kernels import reference as ref
from tests.kernel_checks import (
    assert_close,
    check_rms_norm,
    check_silu_and_mul,
    make_pool,
    nan_like,
    reference_attention,
)

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


@pytest.fixture(scope="module")
def kc():
    pytest.importorskip("cupy")
    import kernels.cuda as kcuda

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
    kc,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    seq_lens: Sequence[int],
    num_kv_heads: int = 2,
    num_splits: int | None = None,
    precision: torch.dtype = torch.float64,
) -> float:
    k, v, tables = make_pool(seq_lens, block_size, num_kv_heads, head_dim, dtype, device=DEVICE)
    num_seqs, num_heads = len(seq_lens), num_kv_heads * group
    q = torch.randn(num_seqs, num_heads, head_dim, device=DEVICE).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = nan_like(q)
    kc.paged_decode_attention(q, k, v, tables, lens, head_dim**-0.5, num_splits=num_splits, out=out)
    expect = reference_attention(q, k, v, tables, seq_lens, range(num_seqs + 1), precision).to(
        out.device
    )
    what = f"decode {dtype} d{head_dim} bs{block_size} g{group} B{num_seqs} splits={num_splits}"
    return assert_close(out, expect, dtype, what)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_grid(kc, dtype: torch.dtype, head_dim: int, block_size: int, group: int) -> None:
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
def test_decode_large(kc, dtype, head_dim, block_size, group, num_seqs, low, high) -> None:
    lens = ragged(num_seqs, low, high, block_size)
    run_decode(kc, dtype, head_dim, block_size, group, lens, precision=torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 33, 300])
def test_decode_split_counts(kc, num_splits: int) -> None:
    """Any split count, including more splits than a sequence has 16-token tiles."""
    lens = [1, 15, 16, 17, 300, 2049, 5000]
    run_decode(kc, torch.bfloat16, 128, 16, 4, lens, num_splits=num_splits)


def test_decode_odd_groups_and_empty_sequences(kc) -> None:
    run_decode(kc, torch.float16, 64, 16, 3, ragged(5, 1, 300, 16), num_kv_heads=3)  # 9 / 3
    run_decode(kc, torch.bfloat16, 128, 16, 20, ragged(3, 1, 500, 16), num_kv_heads=1)  # 2 tiles
    k, v, tables = make_pool([0, 40], 16, 2, 128, torch.bfloat16, device=DEVICE)
    q = torch.randn(2, 4, 128, device=DEVICE).to(torch.bfloat16)
    lens = torch.tensor([0, 40], dtype=torch.int32, device=DEVICE)
    for splits in (1, 3):
        out = kc.paged_decode_attention(q, k, v, tables, lens, 0.1, num_splits=splits)
        assert bool((out[0] == 0).all()), "seq_len 0 must give zeros"
        assert bool(torch.isfinite(out[1]).all())


def test_decode_cuda_graph(kc) -> None:
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
    kc,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    chunks: Sequence[tuple[int, int]],
    num_kv_heads: int = 2,
    block_m: int | None = None,
    precision: torch.dtype = torch.float64,
    entry: str = "prefill",
) -> float:
    """chunks: (new tokens, context already in the pool) per sequence."""
    seq_lens = [n + c for n, c in chunks]
    k, v, tables = make_pool(seq_lens, block_size, num_kv_heads, head_dim, dtype, device=DEVICE)
    cu = [0]
    for n, _ in chunks:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim, device=DEVICE).to(dtype)
    out = nan_like(q)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    if entry == "prefill":
        kwargs = {} if block_m is None else {"block_m": block_m}
        kc.paged_prefill_attention(q, k, v, tables, lens_t, cu_t, scale, out=out, **kwargs)
    else:
        kc.paged_attention(q, k, v, tables, lens_t, cu_t, scale, out=out)
    expect = reference_attention(q, k, v, tables, seq_lens, cu, precision).to(out.device)
    what = f"prefill {dtype} d{head_dim} bs{block_size} g{group} bm{block_m} chunks={chunks[:4]}"
    return assert_close(out, expect, dtype, what)


SMALL_CHUNKS = [(1, 40), (37, 0), (64, 100), (130, 17), (5, 3)]


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_grid(kc, dtype, head_dim, block_size, group, block_m) -> None:
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
def test_prefill_large(kc, dtype, head_dim, block_size, group, chunks) -> None:
    for block_m in (64, 128):
        run_prefill(
            kc, dtype, head_dim, block_size, group, chunks, block_m=block_m,
            precision=torch.float32,
        )  # fmt: skip


def test_paged_attention_mixed_batch(kc) -> None:
    """Decode rows and prefill chunks in one flattened batch, as the engine schedules them."""
    chunks = [(1, random.randint(1, 2000)) for _ in range(40)] + [(900, 0), (300, 1200)]
    random.shuffle(chunks)
    run_prefill(kc, torch.bfloat16, 128, 16, 4, chunks, precision=torch.float32, entry="paged")
    decodes = [(1, random.randint(1, 3000)) for _ in range(33)]
    run_prefill(kc, torch.float16, 128, 16, 4, decodes, precision=torch.float32, entry="paged")


# ---------------------------------------------------------------------------------------------
# store_kv and the per-token layer ops


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_store_kv(kc, dtype, head_dim, index_dtype) -> None:
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
def test_rms_norm(kc, dtype, hidden, with_residual) -> None:
    x = (torch.randn(1000, hidden, device=DEVICE) * 3).to(dtype)
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    residual = torch.randn(1000, hidden, device=DEVICE).to(dtype) if with_residual else None
    check_rms_norm(kc, x, weight, residual, dtype)


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_embedding(kc, dtype, head_dim, pos_dtype) -> None:
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
def test_silu_and_mul(kc, dtype) -> None:
    x = (torch.randn(1000, 2 * 1536, device=DEVICE) * 3).to(dtype)
    check_silu_and_mul(kc, x, dtype)
