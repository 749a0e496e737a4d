"""CPU checks of kernels/*.cu: the real kernel sources, compiled with g++ against the emulator in
tests/kernel_emu/, launched through kernels/cuda.py's real wrappers (argument checks, launch shapes,
split-K choice, kernel arguments) and compared with kernels/reference.py.

The rules of tests/kernels/test_kernels_cuda.py at tiny shapes: pools start NaN-filled and only the
slots a sequence owns get values, outputs start NaN-filled, so a read past a sequence's end or an
element never written shows; tolerance is the per-row relative L2 error against the reference in
float64, <= 1e-2 for bf16 and 5e-3 for fp16. Each case is the smallest that still reaches its code
paths (several warps, several tiles per warp, several splits or row tiles, partial last tiles and
blocks), and asserts the launch shape that proves it. Kernels with barriers run in two emulator
modes: late cp.async copies with low warps running ahead (a missing wait reads poisoned shared
memory), and early copies with high warps running ahead (a stage refilled without a __syncthreads is
overwritten while other warps still read it).

Every attention case also runs over an FP8 pool with scales, against the reference over the same
pool dequantized (so the tolerances are the same); FP8's conversions are checked exactly, the
store on every fp16 and bf16 value and the load on every FP8 value. The emulator runs
common.cu's integer conversions (its path below sm_89), not the sm_89+ cvt instructions: those
are for tests/kernels/test_kernels_cuda.py on a GPU.

Skips without g++ or off Linux. The emulator library (~8 s of g++) is cached by source hash in
~/.cache/llmserve-emu (tests/kernel_emu/emu.py), so only the first run after a kernel edit pays it.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
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
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


@pytest.fixture
def kc(emulator: emu.Emulator, request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """kernels.cuda launching on the emulator; seeds from the test's name, clears the launch
    log and restores the default mode afterwards."""
    import llmserve.kernels.cuda as kcuda

    seed = zlib.crc32(request.node.name.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    emulator.launches.clear()
    yield kcuda
    emulator.copies, emulator.schedule = "late", "low-first"


def launched(emulator: emu.Emulator, name: str) -> list[emu.Launch]:
    return [launch for launch in emulator.launches if launch.expr.startswith(name + "<")]


# ---------------------------------------------------------------------------------------------
# Paged attention


def run_decode(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
    seq_lens: Sequence[int],
    num_splits: int | None,
    entry: str = "decode",
    cache: str = "same",
) -> None:
    """cache: "same" (a pool of q's dtype) or "fp8" (FP8 with k_scale 0.5, v_scale 0.25)."""
    cache_dtype, k_scale, v_scale = CACHES[cache] or (dtype, 1.0, 1.0)
    k, v, tables = make_pool(
        seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, k_scale=k_scale, v_scale=v_scale
    )
    num_seqs, num_heads = len(seq_lens), num_kv_heads * group
    q = torch.randn(num_seqs, num_heads, head_dim).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    cu = list(range(num_seqs + 1))
    out = nan_like(q)
    scale = head_dim**-0.5
    if entry == "decode":
        kc.paged_decode_attention(
            q, k, v, tables, lens, scale, k_scale, v_scale, num_splits=num_splits, out=out
        )
    else:
        cu_t = torch.tensor(cu, dtype=torch.int32)
        kc.paged_attention(q, k, v, tables, lens, cu_t, scale, k_scale, v_scale, out=out)
    live = [b for b, n in enumerate(seq_lens) if n > 0]
    empty = [b for b, n in enumerate(seq_lens) if n == 0]
    assert bool((out[empty] == 0).all()), "seq_len 0 must give zeros"
    expect = reference_attention(q, k, v, tables, seq_lens, cu, torch.float64, k_scale, v_scale)
    what = f"decode {cache} d{head_dim} g{group} {seq_lens}"
    assert_close(out[live], expect[live], dtype, what)


def run_prefill(
    kc: ModuleType,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    group: int,
    num_kv_heads: int,
    chunks: Sequence[tuple[int, int]],
    block_m: int | None,
    cache: str = "same",
) -> None:
    """chunks: (new tokens, context already in the pool) per sequence. block_m None: through
    kernels.cuda.paged_attention, which dispatches. cache: as in run_decode."""
    seq_lens = [n + c for n, c in chunks]
    cache_dtype, k_scale, v_scale = CACHES[cache] or (dtype, 1.0, 1.0)
    k, v, tables = make_pool(
        seq_lens, block_size, num_kv_heads, head_dim, cache_dtype, k_scale=k_scale, v_scale=v_scale
    )
    cu = [0]
    for n, _ in chunks:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_kv_heads * group, head_dim).to(dtype)
    out = nan_like(q)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    scale = head_dim**-0.5
    if block_m is None:
        kc.paged_attention(q, k, v, tables, lens_t, cu_t, scale, k_scale, v_scale, out=out)
    else:
        kc.paged_prefill_attention(
            q, k, v, tables, lens_t, cu_t, scale, k_scale, v_scale, block_m=block_m, out=out
        )
    expect = reference_attention(q, k, v, tables, seq_lens, cu, torch.float64, k_scale, v_scale)
    what = f"prefill {cache} d{head_dim} g{group} bm{block_m} {chunks}"
    assert_close(out, expect, dtype, what)


# Emulator modes for the kernels with barriers: late copies with low warps ahead, early copies
# with high warps ahead (see tests/kernel_emu/emu.py).
MODES = {"late-low": ("late", "low-first"), "early-high": ("early", "high-first")}
# KV pools: q's dtype, or FP8 holding K / 0.5 and V / 0.25 (dtype, k_scale, v_scale).
CACHES: dict[str, tuple[torch.dtype, float, float] | None] = {
    "same": None,
    "fp8": (FP8, 0.5, 0.25),
}

# (dtype, head_dim, block_size, group, num_kv_heads, seq_lens, num_splits)
DECODE_CASES = {
    # MHA, one split: 130 tokens = 9 tiles, so warp 0 refills both stages (tiles 0, 4, 8) and
    # every warp has work; 1, 15, 16, 17: partial and exact blocks.
    "mha-one-split": (torch.float16, 64, 16, 1, 2, [1, 15, 130, 16, 17], 1),
    # GQA 12 (rows 12-15 of the head tile unused), 3 splits: 200 tokens -> splits of 5, 5, 3
    # tiles; 5 tokens -> one active split and two empty ones; 0 tokens -> zeros.
    "gqa12-three-splits": (torch.bfloat16, 128, 32, 12, 2, [200, 5, 0, 33], 3),
    # GQA 20: two head tiles per kv head, the second one partial; split count left to the
    # wrappers' heuristic (one split at this size).
    "gqa20-auto-splits": (torch.float16, 64, 16, 20, 1, [70, 40], None),
    # Token-level KV (block size 1): every row of a tile reads its own table entry; 2 splits,
    # partial last tiles.
    "token-level": (torch.bfloat16, 64, 1, 4, 2, [37, 1, 70], 2),
    # Blocks of 4: four table entries per tile.
    "blocks-of-4": (torch.float16, 64, 4, 2, 2, [18, 47], 1),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode(kc: ModuleType, emulator: emu.Emulator, case: str, mode: str, cache: str) -> None:
    dtype, head_dim, block_size, group, num_kv_heads, seq_lens, num_splits = DECODE_CASES[case]
    emulator.copies, emulator.schedule = MODES[mode]
    run_decode(
        kc, dtype, head_dim, block_size, group, num_kv_heads, seq_lens, num_splits, cache=cache
    )
    (main,) = launched(emulator, "paged_decode_kernel")
    assert (", fp8e4m3_t, " in main.expr) == (cache == "fp8")
    assert main.grid == (num_kv_heads * -(-group // 16), len(seq_lens), num_splits or 1)
    assert len(launched(emulator, "paged_decode_merge_kernel")) == (main.grid[2] > 1)


# (dtype, head_dim, block_size, group, num_kv_heads, chunks of (new tokens, context), block_m)
PREFILL_CASES = {
    # <NW 4, MT 1, BN 64>, Q in registers: 126 + 70 tokens -> 4 key tiles (stages refilled), the
    # first unmasked and the second ending at the first row's position + 2 (the edge of the mask
    # skip); 70 rows -> 2 row tiles, the second partial; a decode row; a chunk without context.
    "bm64-d64": (torch.float16, 64, 16, 1, 2, [(40, 0), (1, 30), (70, 126)], 64),
    # <NW 4, MT 2, BN 32>, Q re-read from shared memory (MT * HD > 128): GQA 4 gives 132 rows ->
    # 2 row tiles, the second partial; 62 + 20 tokens -> 3 key tiles, the second ending at the
    # first row's position + 2; block_size 48 (not a power of two).
    "bm128-d128-gqa": (torch.bfloat16, 128, 48, 4, 2, [(33, 0), (20, 62), (1, 5)], 128),
    # <NW 4, MT 1, BN 64> at head_dim 128 (the largest shared memory, 87,040 bytes), GQA 8.
    "bm64-d128-gqa": (torch.float16, 128, 32, 8, 1, [(9, 64), (17, 0)], 64),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill(kc: ModuleType, emulator: emu.Emulator, case: str, mode: str, cache: str) -> None:
    dtype, head_dim, block_size, group, num_kv_heads, chunks, block_m = PREFILL_CASES[case]
    emulator.copies, emulator.schedule = MODES[mode]
    run_prefill(kc, dtype, head_dim, block_size, group, num_kv_heads, chunks, block_m, cache)
    (launch,) = launched(emulator, "paged_prefill_kernel")
    assert (", fp8e4m3_t, " in launch.expr) == (cache == "fp8")
    num_tokens = sum(n for n, _ in chunks)
    assert launch.grid == (num_tokens * group // block_m + len(chunks), num_kv_heads, 1)


@pytest.mark.parametrize("cache", list(CACHES))
def test_paged_attention_dispatch(kc: ModuleType, emulator: emu.Emulator, cache: str) -> None:
    """A batch of decodes goes to the decode kernel, with the split count the wrappers choose
    (4 for 600 tokens on 132 SMs); a mixed batch to the prefill kernel at its default block_m
    (<NW 4, MT 2, BN 32> with Q in registers at head_dim 64). The scales reach both."""
    run_decode(kc, torch.bfloat16, 64, 16, 2, 2, [600, 7], None, entry="paged", cache=cache)
    (main,) = launched(emulator, "paged_decode_kernel")
    assert main.grid == (2, 2, 4)
    run_prefill(kc, torch.float16, 64, 16, 2, 2, [(1, 50), (24, 0), (1, 9)], None, cache)
    (launch,) = launched(emulator, "paged_prefill_kernel")
    assert launch.expr.endswith(", 64, 4, 2, 32>")


# ---------------------------------------------------------------------------------------------
# store_kv and the per-token layer ops


@pytest.mark.parametrize(
    ("dtype", "head_dim", "index_dtype"),
    [(torch.float16, 64, torch.int32), (torch.bfloat16, 128, torch.int64)],
)
def test_store_kv(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, index_dtype: torch.dtype
) -> None:
    """37 tokens of strided key / value views into shuffled slots, every 5th a padding row."""
    num_tokens, num_heads, num_kv_heads, block_size, num_blocks = 37, 4, 2, 16, 6
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::5] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape).to(dtype)
    v = torch.randn(shape).to(dtype)
    k_ref, v_ref = k.clone(), v.clone()
    kc.store_kv(key, value, k, v, slots.to(index_dtype))
    ref.store_kv(key, value, k_ref, v_ref, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("scale", [1.0, 0.3])
@pytest.mark.parametrize(
    ("dtype", "index_dtype"), [(torch.float16, torch.int32), (torch.bfloat16, torch.int64)]
)
def test_store_kv_fp8_every_value(
    kc: ModuleType, dtype: torch.dtype, index_dtype: torch.dtype, scale: float
) -> None:
    check_store_kv_fp8_every_value(kc, dtype, index_dtype, scale)


def test_store_kv_fp8_nan_stays_nan(kc: ModuleType) -> None:
    key = torch.full((1, 1, 64), float("nan"), dtype=torch.bfloat16)
    k, v = torch.zeros(1, 16, 1, 64, dtype=FP8), torch.zeros(1, 16, 1, 64, dtype=FP8)
    kc.store_kv(key, key, k, v, torch.tensor([3], dtype=torch.int32))
    assert bool(k[0, 3].float().isnan().all()) and bool(v[0, 3].float().isnan().all())


@pytest.mark.parametrize("entry", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp8_load_is_exact_for_every_value(kc: ModuleType, dtype: torch.dtype, entry: str) -> None:
    check_fp8_load_exact(kc, dtype, entry)


def test_fp8_software_conversions_are_common_cu_verbatim() -> None:
    """The emulator's FP8 conversions are kernels/common.cu's own (its path below sm_89)."""

    def block(path: Path) -> str:
        text = path.read_text()
        start = text.index("// fp8-software-begin")
        return text[start : text.index("// fp8-software-end", start)]

    import llmserve.kernels.cuda as kcuda

    assert block(kcuda.KERNEL_DIR / "common.cu") == block(emu.HEADER)


def test_kv_cache_dtype_and_scale_checks(kc: ModuleType) -> None:
    """A cache of q's dtype or FP8 only, both halves alike; scales other than 1 only for FP8."""
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)

    def decode(k: torch.Tensor, v: torch.Tensor, **scales: float) -> None:
        kc.paged_decode_attention(q, k, v, tables, lens, 0.1, **scales)

    def pool(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(1, 16, 2, 64, dtype=dtype)

    fp8, f16 = pool(FP8), pool(torch.float16)
    with pytest.raises(ValueError, match=r"k_cache.dtype=torch.float16 does not go with q.dtype"):
        decode(f16, f16)
    with pytest.raises(ValueError, match=r"k_cache.dtype=torch.float32 does not go with q.dtype"):
        decode(pool(torch.float32), pool(torch.float32))
    with pytest.raises(ValueError, match=r"v_cache.dtype=torch.bfloat16 must equal k_cache"):
        decode(fp8, pool(torch.bfloat16))
    with pytest.raises(ValueError, match=r"k_scale=2\.0 applies only to a float8_e4m3fn cache"):
        decode(pool(torch.bfloat16), pool(torch.bfloat16), k_scale=2.0)
    with pytest.raises(ValueError, match=r"v_scale=0\.0 must be a finite positive number"):
        decode(fp8, fp8, v_scale=0.0)
    key = torch.zeros(3, 2, 64, dtype=torch.float16)
    slots = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"k_cache.dtype=torch.bfloat16 does not go with key"):
        kc.store_kv(key, key, pool(torch.bfloat16), pool(torch.bfloat16), slots)
    with pytest.raises(ValueError, match=r"k_scale=nan must be a finite positive number"):
        kc.store_kv(key, key, fp8, fp8, slots, float("nan"))


@pytest.mark.parametrize(
    ("dtype", "hidden", "with_residual"),
    [
        (torch.float16, 576, True),  # 72 chunks -> 3 warps reduce through shared memory
        (torch.bfloat16, 8320, False),  # 1040 chunks > 1024 threads: a second pass per thread
    ],
)
@pytest.mark.parametrize("mode", list(MODES))
def test_rms_norm(
    kc: ModuleType,
    emulator: emu.Emulator,
    dtype: torch.dtype,
    hidden: int,
    with_residual: bool,
    mode: str,
) -> None:
    emulator.copies, emulator.schedule = MODES[mode]
    x = (torch.randn(3, hidden) * 3).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    residual = torch.randn(3, hidden).to(dtype) if with_residual else None
    check_rms_norm(kc, x, weight, residual, dtype)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "pos_dtype"),
    [(torch.float16, 64, torch.int64), (torch.bfloat16, 128, torch.int32)],
)
def test_rotary_embedding(
    kc: ModuleType, dtype: torch.dtype, head_dim: int, pos_dtype: torch.dtype
) -> None:
    """Exact: the kernel rounds as the reference's float32 x1 * cos - x2 * sin does."""
    num_tokens, num_heads, num_kv_heads, max_position = 37, 3, 1, 512
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided view
    positions = torch.randint(0, max_position, (num_tokens,))
    expect = ref.rotary_embedding(positions, q, cache)
    got = kc.rotary_embedding(positions.to(pos_dtype), q, cache, out=nan_like(expect))
    assert torch.equal(got, expect)
    kc.rotary_embedding(positions.to(pos_dtype), q, cache, out=q)  # in place on the view
    assert torch.equal(q, got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_and_mul(kc: ModuleType, dtype: torch.dtype) -> None:
    x = (torch.randn(5, 2 * 344) * 3).to(dtype)  # 215 threads: a partial CTA
    check_silu_and_mul(kc, x, dtype)


# ---------------------------------------------------------------------------------------------
# Weight-only int8 linear (int8_gemm.cu)

# (rows of x, output channels, K, path): the instance and launch shape each case must reach
INT8_CASES = {
    # GEMV M=1: 20 channels = 2 CTAs of 8 and a third with one warp of 2 rows and 3 idle warps;
    # K 48: lanes 3-31 have no chunk
    "gemv-1": (1, 20, 48, "auto", "int8_gemv_kernel<{}, 1, 2>", (3, 1, 1)),
    # M=2; an odd channel count: the last warp's second row is past N. K 2576: every lane runs
    # the 4-chunk loop once, then lane 0 two single chunks and the others one
    "gemv-2": (2, 9, 2576, "auto", "int8_gemv_kernel<{}, 2, 2>", (2, 1, 1)),
    # 3 rows on the M=4 instance (row 4 clamped, never written); K 1040: every lane runs the
    # 2-chunk loop once, and lane 0 one more chunk
    "gemv-3": (3, 17, 1040, "auto", "int8_gemv_kernel<{}, 4, 4>", (2, 1, 1)),
    "gemv-4": (4, 16, 64, "auto", "int8_gemv_kernel<{}, 4, 4>", (1, 1, 1)),
    "gemv-8": (8, 12, 528, "auto", "int8_gemv_kernel<{}, 8, 4>", (1, 1, 1)),
    # 9 rows: the GEMM; 2 channel tiles, the second with 2 of 128 channels; K 48: a full k tile
    # and a half one (zero-filled 16)
    "gemm-9": (9, 130, 48, "auto", "int8_gemm_kernel<{}>", (1, 2, 1)),
    # 70 rows: two row tiles, the second with 6 of 64; 3 k tiles through both stages
    "gemm-70": (70, 24, 96, "auto", "int8_gemm_kernel<{}>", (2, 1, 1)),
    # the GEMM asked for at 2 rows (most of its tile is padding)
    "gemm-2": (2, 8, 32, "gemm", "int8_gemm_kernel<{}>", (1, 1, 1)),
    # split-K (2 tiles fill no GPU): 16 k tiles in 4 splits of 4, then the finalize kernel
    "gemm-split-4": (9, 130, 512, "auto", "int8_gemm_kernel<{}>", (1, 2, 4)),
    # 13 k tiles in 3 splits of 5, 5 and 3
    "gemm-split-3": (16, 40, 400, "auto", "int8_gemm_kernel<{}>", (1, 1, 3)),
}


def run_int8_linear(kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, case: str) -> None:
    from llmserve.kernels import int8 as ki

    num_rows, n, k, path, expr, grid = INT8_CASES[case]
    weight = torch.randn(n, k) * torch.rand(n, 1)  # channels of different ranges
    q, scales = ref.quantize_int8_per_channel(weight)
    x = (torch.randn(num_rows, k) * 2).to(dtype)
    wide = torch.full((num_rows, -(-n // 8) * 8 + 8), float("nan"), dtype=dtype)
    out = wide[:, :n]  # a strided output; the padding columns must stay NaN
    got = kc.int8_linear(x, ki.pack_weight(q), scales, out=out, path=path)
    assert got.data_ptr() == out.data_ptr()
    ctype = "bf16_t" if dtype == torch.bfloat16 else "f16_t"
    launch, *rest = emulator.launches
    assert (launch.expr, launch.grid) == (expr.format(ctype), grid)
    finalize = [f"int8_gemm_finalize_kernel<{ctype}>"] if grid[2] > 1 else []
    assert [later.expr for later in rest] == finalize
    assert bool(wide[:, n:].isnan().all()), "a store past N"
    expect = ref.int8_linear(x.double(), q, scales.double())
    assert_close(got, expect, dtype, f"int8_linear {case}")
    # the reference in x's dtype rounds the same float32 sums: at most one unit in the last place
    ulp = torch.finfo(dtype).eps * ref.int8_linear(x, q, scales).float().abs()
    assert bool(((got.float() - ref.int8_linear(x, q, scales).float()).abs() <= ulp).all())


@pytest.mark.parametrize("case", list(INT8_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int8_linear(kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, case: str) -> None:
    run_int8_linear(kc, emulator, dtype, case)


@pytest.mark.parametrize("case", ["gemm-9", "gemm-70", "gemm-split-3"])
def test_int8_gemm_stage_orderings(kc: ModuleType, emulator: emu.Emulator, case: str) -> None:
    """The GEMM's two cp.async stages under the other emulator mode (early copies, high warps
    first): a stage refilled before every warp has read it shows."""
    emulator.copies, emulator.schedule = MODES["early-high"]
    run_int8_linear(kc, emulator, torch.bfloat16, case)


def test_int8_linear_checks(kc: ModuleType) -> None:
    from llmserve.kernels import int8 as ki

    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    w, s = torch.zeros(8, 32, dtype=torch.int8), torch.ones(8)

    def fails(match: str, *args: torch.Tensor, **kw: object) -> None:
        with pytest.raises(ValueError, match=match):
            kc.int8_linear(*args, **kw)

    fails(r"x.dtype=torch.float32 is not supported", x.float(), w, s)
    fails(r"x.shape\[1\]=24 \(K\) must be a positive multiple of 16", x[:, :24], w[:, :24], s)
    fails(r"weight.dtype=torch.uint8 is not supported; expected int8", x, w.view(torch.uint8), s)
    fails(r"weight.shape\[1\]=16 must be 32", x, w[:, :16].contiguous(), s)
    fails(r"weight must be contiguous", x, torch.zeros(32, 8, dtype=torch.int8).t(), s)
    fails(r"scales.dtype=torch.bfloat16 is not supported; expected float32", x, w, s.bfloat16())
    fails(r"scales.shape\[0\]=7 must be 8", x, w, s[:7])
    fails(
        r"x.stride\(0\)=33 must be a multiple of 8", torch.zeros(2, 33, dtype=x.dtype)[:, :32], w, s
    )
    fails(r"path='tiles' must be one of", x, w, s, path="tiles")
    fails(r"path='gemv' serves at most 8 rows of x, got 9", torch.zeros(9, 32, dtype=x.dtype), w, s,
          path="gemv")  # fmt: skip
    fails(r"out.dtype=torch.float16 is not supported", x, w, s, out=torch.zeros(2, 8).half())
    with pytest.raises(ValueError, match=r"pack_weight: K=40 must be a multiple of 16"):
        ki.pack_weight(torch.zeros(2, 40, dtype=torch.int8))
    assert kc.int8_linear(x[:0], w, s).shape == (0, 8)  # nothing to launch


def test_int8_bench_section_runs(
    kc: ModuleType, emulator: emu.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/studies/int8_bench.py end to end at toy shapes on the emulator (timing faked: no GPU),
    so the GPU session's benchmark does not fail on its own code; its rows carry the fields the GPU
    check's summary reads."""
    from bench.studies import int8_bench

    monkeypatch.setattr(int8_bench, "SHAPES", {"q/o": (16, 32), "down": (24, 64)})
    monkeypatch.setattr(int8_bench, "WORKING_SET_BYTES", 2000)

    def fake_time(fn: Callable[[], object]) -> dict[str, float]:
        fn()
        return {"ms": 0.01}

    def attempt(fn: Callable[[], dict]) -> dict:
        return fn()

    rows = int8_bench.run_all(fake_time, 4.28, torch.device("cpu"), attempt, quick=True)
    assert [(r["shape"], r["batch"]) for r in rows] == [("q/o", 1), ("q/o", 16), ("down", 1),
                                                        ("down", 16)]  # fmt: skip
    for r in rows:
        assert r["rel_error_vs_fp32"] < 1e-2
        assert {"gbps", "pct_of_copy", "us"} <= set(r["int8"]) and r["speedup_vs_bf16"] > 0
        assert (r["gbps"], r["pct_of_copy"]) == (r["int8"]["gbps"], r["int8"]["pct_of_copy"])
    lines = int8_bench.summary(rows)
    assert lines[-1] == "  int8 batch 1 >= 75% of copy (q/o, down): no"
