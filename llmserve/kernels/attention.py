"""The attention kernels' wrappers: store_kv (the pool writer, store_kv.cu), paged decode
attention (split-K) and paged varlen prefill attention.

Each public function mirrors one in kernels/reference.py (the ground truth and the CPU path;
the pool layout is the one it describes), but takes its per-step metadata as device tensors:
`seq_lens`, `cu_seqlens_q` and `block_tables` int32, `slot_mapping` int32 or int64. Every function
checks shapes, strides, dtypes and devices before launching and raises ValueError naming the
argument, its value and the limit. An FP8 pool (k_scale / v_scale) is its own compiled template
instance: kernels/README.md#fp8-kv-pool-format-and-scales.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np
import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    _INDEX_CTYPES,
    FP8_CTYPE,
    ModuleSpec,
    _check,
    _check_contiguous,
    _check_rows16,
    _f32,
    _fail,
    _i32,
    _i64,
    _output,
    _ptr,
)
from llmserve.kernels.reference import FP8_DTYPE, check_kv_scales

LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)
DECODE_TILE = 16  # tokens per warp step in decode_attention.cu
DECODE_THREADS = 128
# prefill_attention.cu instances by rows per CTA: (warps, 16-row m-tiles per warp, keys per tile)
PREFILL_CONFIGS: dict[int, tuple[int, int, int]] = {64: (4, 1, 64), 128: (4, 2, 32)}
PREFILL_DEFAULT_BLOCK_M = 128
# Resident CTAs per SM of paged_decode_kernel on sm_90, from `nvcc -Xptxas -v` (registers with
# __launch_bounds__(128, 3): 168 for head_dim 128, 124 for 64) and its shared memory.
_DECODE_CTAS_PER_SM = {64: 4, 128: 3}


def store_kv_spec(fp8_ctype: str | None = None) -> ModuleSpec:
    """The plain copy (a cache of the input's dtype), or with `fp8_ctype` (the input's ctype) the
    quantizing store into an FP8 cache."""
    if fp8_ctype is None:
        exprs = tuple(f"store_kv_kernel<{c}>" for c in _INDEX_CTYPES.values())
    else:
        exprs = tuple(f"store_kv_fp8_kernel<{fp8_ctype}, {c}>" for c in _INDEX_CTYPES.values())
    return ModuleSpec("store_kv.cu", exprs)


def decode_spec(ctype: str, head_dim: int, cache_ctype: str | None = None) -> ModuleSpec:
    """cache_ctype: the KV pool's element type, q's (`ctype`, the default) or FP8_CTYPE."""
    return ModuleSpec(
        "decode_attention.cu",
        (
            f"paged_decode_kernel<{ctype}, {cache_ctype or ctype}, {head_dim}>",
            f"paged_decode_merge_kernel<{ctype}, {head_dim}>",
        ),
    )


def prefill_expr(ctype: str, head_dim: int, block_m: int, cache_ctype: str | None = None) -> str:
    warps, m_tiles, keys = PREFILL_CONFIGS[block_m]
    kv = cache_ctype or ctype
    return f"paged_prefill_kernel<{ctype}, {kv}, {head_dim}, {warps}, {m_tiles}, {keys}>"


def prefill_spec(ctype: str, head_dim: int, cache_ctype: str | None = None) -> ModuleSpec:
    exprs = tuple(prefill_expr(ctype, head_dim, m, cache_ctype) for m in PREFILL_CONFIGS)
    return ModuleSpec("prefill_attention.cu", exprs)


def _check_kv_cache(
    op: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    k_scale: float,
    v_scale: float,
    like: str = "q",
) -> tuple[int, int, int, int]:
    """The pool: of `like`'s `dtype` or FP8, both halves alike, contiguous; the scales fit it.
    Returns (num_blocks, block_size, num_kv_heads, head_dim)."""
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype not in (dtype, FP8_DTYPE):
        _fail(
            op,
            f"k_cache.dtype={k_cache.dtype} does not go with {like}.dtype={dtype}: the kernels "
            f"read a cache of {like}'s dtype or of torch.float8_e4m3fn",
        )
    _check(op, "k_cache", k_cache, ndim=4, dtypes=(dtype, FP8_DTYPE), device=device)
    if v_cache.dtype != k_cache.dtype:
        _fail(op, f"v_cache.dtype={v_cache.dtype} must equal k_cache.dtype={k_cache.dtype}")
    _check(op, "v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device,
           shape=k_cache.shape)  # fmt: skip
    try:
        check_kv_scales(k_cache.dtype, k_scale, v_scale)
    except ValueError as err:
        _fail(op, str(err))
    for name, pool in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_contiguous(op, name, pool)
        _check_rows16(op, name, pool)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def _check_attention_args(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_seqs: int,
    k_scale: float,
    v_scale: float,
) -> tuple[int, int, int, int]:
    """Returns (num_heads, num_kv_heads, head_dim, block_size)."""
    _check(op, "q", q, ndim=3, dtypes=tuple(_CTYPES))
    _check_rows16(op, "q", q)
    _, block_size, num_kv_heads, head_dim = _check_kv_cache(
        op, k_cache, v_cache, q.dtype, q.device, k_scale, v_scale
    )
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        _fail(op, f"q.shape[2]={q.shape[2]} must equal the cache's head_dim={head_dim}")
    if head_dim not in HEAD_DIMS:
        _fail(op, f"head_dim={head_dim} is not supported; expected one of {HEAD_DIMS}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        _fail(op, f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    _check(op, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=q.device)
    if block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        _fail(
            op,
            f"block_tables must be [num_seqs={num_seqs}, max_blocks] with contiguous rows, got "
            f"shape {tuple(block_tables.shape)} strides {block_tables.stride()}",
        )
    _check(op, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device)
    _check_contiguous(op, "seq_lens", seq_lens)
    return num_heads, num_kv_heads, head_dim, block_size


# ---------------------------------------------------------------------------------------------
# Ops


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write rows `key[t]`, `value[t]` ([T, num_kv_heads, head_dim]) to slot `slot_mapping[t]`
    (reference.store_kv).

    Slot -1 marks a padding row and is skipped. Modifies k_cache and v_cache in place. key / value
    are fp16 or bf16; the cache has their dtype (a plain copy; scales must be 1.0) or is
    torch.float8_e4m3fn (key / k_scale and value / v_scale rounded to nearest even, saturating to
    +-448, bit for bit as reference.quantize_kv). Slots must lie inside the pool (not checked:
    that would need a device sync).
    """
    op = "store_kv"
    _check(op, "key", key, ndim=3, dtypes=tuple(_CTYPES))
    _, _, num_kv_heads, head_dim = _check_kv_cache(
        op, k_cache, v_cache, key.dtype, key.device, k_scale, v_scale, like="key"
    )
    shape = (key.shape[0], num_kv_heads, head_dim)
    _check(op, "key", key, ndim=3, dtypes=(key.dtype,), device=key.device, shape=shape)
    _check(op, "value", value, ndim=3, dtypes=(key.dtype,), device=key.device, shape=shape)
    _check_rows16(op, "key", key)
    _check_rows16(op, "value", value)
    _check(op, "slot_mapping", slot_mapping, ndim=1, dtypes=tuple(_INDEX_CTYPES), device=key.device)
    _check_contiguous(op, "slot_mapping", slot_mapping)
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(op, f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    if head_dim % 8:
        _fail(op, f"head_dim={head_dim} must be a multiple of 8")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    threads = num_tokens * num_kv_heads * head_dim // 8
    args: tuple[Any, ...] = (
        _ptr(key), _i64(key.stride(0)), _i64(key.stride(1)),
        _ptr(value), _i64(value.stride(0)), _i64(value.stride(1)),
        _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping),
        _i32(num_tokens), _i32(num_kv_heads), _i32(head_dim),
    )  # fmt: skip
    index_ctype = _INDEX_CTYPES[slot_mapping.dtype]
    if k_cache.dtype == FP8_DTYPE:
        ctype = _CTYPES[key.dtype]
        spec = store_kv_spec(ctype)
        expr = f"store_kv_fp8_kernel<{ctype}, {index_ctype}>"
        args += (_f32(k_scale), _f32(v_scale))
    else:
        spec, expr = store_kv_spec(), f"store_kv_kernel<{index_ctype}>"
    launch._launch(spec, expr, (-(-threads // 256),), (256,), args, 0, key.device)


def decode_smem_bytes(head_dim: int, fp8: bool = False) -> int:
    """4 warps x 2 stages x (K + V) x 16 rows x (head_dim + 8) x 2 bytes; with an FP8 cache,
    4 warps x (2 stages x (K + V) x 16 rows x head_dim bytes + one T tile of K and V)."""
    tile = 2 * DECODE_TILE * (head_dim + 8) * 2
    if fp8:
        return 4 * (2 * 2 * DECODE_TILE * head_dim + tile)
    return 4 * 2 * tile


def decode_ctas_per_seq(num_heads: int, num_kv_heads: int) -> int:
    """paged_decode_kernel's CTAs per sequence (and split): one per KV head and 16 query heads
    of its group."""
    return num_kv_heads * -(-(num_heads // num_kv_heads) // 16)


def decode_slots(device: torch.device, head_dim: int) -> int:
    """CTAs of paged_decode_kernel resident on the whole GPU at once (decode_num_splits' slots)."""
    return launch._num_sms(device) * _DECODE_CTAS_PER_SM[head_dim]


@lru_cache(maxsize=4096)
def decode_num_splits(num_ctas: int, max_seq_len: int, slots: int) -> int:
    """How many pieces to cut each context into, by a small cost model counted in warp steps of
    16 tokens: ceil(waves) x (steps per CTA + 2 for its fixed work), plus 2 for the merge launch.
    `num_ctas` = num_seqs x kv-head tiles; `slots` = CTAs resident on the whole GPU at once."""
    max_tiles = max(1, -(-max_seq_len // DECODE_TILE))
    limit = max(1, min(max_tiles // 8, 256))  # keep >= 2 tiles per warp in each split

    def cost(splits: int) -> float:
        waves = -(-num_ctas * splits // slots)
        steps = -(-max_tiles // (4 * splits))
        return waves * (steps + 2) + (2 if splits > 1 else 0)

    return min(range(1, limit + 1), key=cost)  # the fewest splits among equal costs


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence over its context in the paged pool (reference.paged_attention with
    cu_seqlens_q = arange(num_seqs + 1), window and softcap included: the blocks wholly before
    the window are not read). The pool is q's dtype, or FP8 with k_scale / v_scale.
    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, >= ceil(seq_len / block_size)]
    int32; seq_lens: [num_seqs] int32, the context length including this step's token (already
    stored). Any block_size (token-level KV: 1). Returns [num_seqs, num_heads, head_dim] in q's
    dtype (written into `out` when given); a sequence with seq_len 0 gets zeros. num_splits
    (split-K): chosen from max_seq_len and the GPU's size when not given. Without
    max_seq_len it is read from seq_lens, which synchronizes with the device: CUDA-graph callers
    pass both, fixed per captured batch size. sinks: float32 [num_heads], gpt-oss's learned
    logit per head in each softmax's denominator (reference._softmax_with_sinks).
    """
    op = "paged_decode_attention"
    num_seqs, num_heads, num_kv_heads, head_dim, block_size = _check_decode_args(
        op, q, k_cache, v_cache, block_tables, seq_lens, k_scale, v_scale
    )
    out = _output(op, out, (num_seqs, num_heads, head_dim), q)
    sinks_ptr = _sinks_arg(op, sinks, num_heads, q.device)
    if num_seqs == 0:
        return out
    num_ctas = decode_ctas_per_seq(num_heads, num_kv_heads) * num_seqs
    num_splits = _choose_splits(op, num_splits, num_ctas, max_seq_len, seq_lens, head_dim)
    fp8 = k_cache.dtype == FP8_DTYPE
    spec = decode_spec(_CTYPES[q.dtype], head_dim, FP8_CTYPE if fp8 else None)
    part_args, _workspace = _split_workspace(num_splits, num_seqs, num_heads, head_dim, q.device)
    smem = decode_smem_bytes(head_dim, fp8)
    args = (
        _ptr(q), _i64(q.stride(0)), _i64(q.stride(1)),
        _ptr(k_cache), _ptr(v_cache),
        _ptr(block_tables), _i64(block_tables.stride(0)), _ptr(seq_lens),
        _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)),
        *part_args,
        _i32(num_seqs), _i32(num_heads), _i32(num_kv_heads), _i32(block_size),
        _f32(scale * LOG2E), _i32(num_splits), _f32(k_scale), _f32(v_scale),
        *_window_softcap(op, window, softcap), sinks_ptr,
    )  # fmt: skip
    grid = (num_ctas // num_seqs, num_seqs, num_splits)
    launch._launch(spec, spec.name_expressions[0], grid, (DECODE_THREADS,), args, smem, q.device)
    if num_splits > 1:
        _launch_decode_merge(spec, part_args, seq_lens, out, num_splits, window or 0, sinks_ptr)
    return out


def _choose_splits(
    op: str,
    num_splits: int | None,
    num_ctas: int,
    max_seq_len: int | None,
    seq_lens: torch.Tensor,
    head_dim: int,
) -> int:
    """num_splits as given, else decode_num_splits' choice (max_seq_len read from seq_lens when
    it is not given: a device sync); checked."""
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        slots = decode_slots(seq_lens.device, head_dim)
        num_splits = decode_num_splits(num_ctas, max_seq_len, slots)
    if not 1 <= num_splits <= 65535:
        _fail(op, f"num_splits={num_splits} must be in [1, 65535]")
    return num_splits


def _sinks_arg(
    op: str, sinks: torch.Tensor | None, num_heads: int, device: torch.device
) -> np.uint64:
    """The kernels' sinks pointer (null for none), checked: float32 [num_heads], contiguous."""
    if sinks is None:
        return np.uint64(0)
    _check(op, "sinks", sinks, ndim=1, dtypes=(torch.float32,), device=device, shape=(num_heads,))
    _check_contiguous(op, "sinks", sinks)
    return _ptr(sinks)


def _window_softcap(op: str, window: int | None, softcap: float | None) -> tuple[np.generic, ...]:
    """The kernels' (window, softcap_log2) arguments: 0 for none."""
    if window is not None and window < 1:
        _fail(op, f"window={window} must be at least 1 (None: no window)")
    if softcap is not None and not softcap > 0:
        _fail(op, f"softcap={softcap} must be positive (None: no cap)")
    return _i32(window or 0), _f32(softcap * LOG2E if softcap else 0.0)


def _check_decode_args(
    op: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> tuple[int, int, int, int, int]:
    """Returns (num_seqs, num_heads, num_kv_heads, head_dim, block_size)."""
    num_seqs = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1
    num_heads, num_kv_heads, head_dim, block_size = _check_attention_args(
        op, q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale
    )
    if seq_lens.shape[0] != num_seqs:
        _fail(op, f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} sequences")
    return num_seqs, num_heads, num_kv_heads, head_dim, block_size


def _split_workspace(
    num_splits: int, num_seqs: int, num_heads: int, head_dim: int, device: torch.device
) -> tuple[tuple[np.uint64, np.uint64], tuple[torch.Tensor, ...]]:
    """(pointers, tensors): split-K's float32 partials (accumulators, and max / sum of
    exponentials) for the decode kernel, null pointers when there is one split (it writes `out`
    directly). The caller holds the tensors until the kernels are queued."""
    if num_splits == 1:
        return (np.uint64(0), np.uint64(0)), ()
    parts = (num_splits, num_seqs, num_heads)
    part_acc = torch.empty((*parts, head_dim), dtype=torch.float32, device=device)
    part_ml = torch.empty((*parts, 2), dtype=torch.float32, device=device)
    return (_ptr(part_acc), _ptr(part_ml)), (part_acc, part_ml)


def _launch_decode_merge(
    spec: ModuleSpec,
    part_args: tuple[np.uint64, np.uint64],
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_splits: int,
    window: int,
    sinks_ptr: np.uint64,
) -> None:
    """paged_decode_merge_kernel: combine the splits' partials into `out` [num_seqs, heads, D]."""
    num_seqs, num_heads, head_dim = out.shape
    merge_args = (
        *part_args, _ptr(seq_lens),
        _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)),
        _i32(num_seqs), _i32(num_heads), _i32(num_splits), _i32(window), sinks_ptr,
    )  # fmt: skip
    expr = spec.name_expressions[1]
    launch._launch(spec, expr, (num_heads, num_seqs), (head_dim,), merge_args, 0, out.device)


def prefill_smem_bytes(head_dim: int, block_m: int, fp8: bool = False) -> int:
    """(Q tile of block_m rows + K and V tiles of BN keys, two stages) x (head_dim + 8) x 2 B;
    with an FP8 cache one K and V tile of T, plus the FP8 tiles (two stages) of head_dim bytes."""
    keys = PREFILL_CONFIGS[block_m][2]
    if fp8:
        return (block_m + 2 * keys) * (head_dim + 8) * 2 + 4 * keys * head_dim
    return (block_m + 4 * keys) * (head_dim + 8) * 2


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    block_m: int = PREFILL_DEFAULT_BLOCK_M,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    tree_bits: torch.Tensor | None = None,
    tree_start: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole context in the paged pool:
    reference.paged_attention with device metadata. The pool is q's dtype, or FP8 with k_scale /
    v_scale. q: [T, num_heads, head_dim], requests one after another; cu_seqlens_q:
    [num_seqs + 1] int32 offsets into q (cu_seqlens_q[-1] <= T); seq_lens: [num_seqs] int32
    context lengths including this step's tokens, whose K/V must already be stored;
    block_tables: [num_seqs, >= ceil(seq_len / block_size)] int32. Any block_size. Needs no
    host-side metadata (graph-safe). Returns [T, num_heads, head_dim] in q's dtype (rows past
    cu_seqlens_q[-1] are not written). block_m: (query token, head) rows per CTA, a key of
    PREFILL_CONFIGS. window, softcap: as paged_decode_attention's (key tiles wholly before a row
    tile's window are not read). tree_bits [T] int64 and tree_start [num_seqs] int32: token
    trees (prefill_attention.cu's header), without a window. sinks: as paged_decode_attention's."""
    op = "paged_prefill_attention"
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    num_heads, num_kv_heads, head_dim, block_size = _check_attention_args(
        op, q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale
    )
    _check_prefill_args(op, cu_seqlens_q, num_seqs, block_m, q.device)
    num_tokens = q.shape[0]
    tree = _tree_args(op, tree_bits, tree_start, num_tokens, num_seqs, window, q.device)
    out = _output(op, out, (num_tokens, num_heads, head_dim), q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    grid = (num_tokens * group // block_m + num_seqs, num_kv_heads)
    fp8 = k_cache.dtype == FP8_DTYPE
    cache_ctype = FP8_CTYPE if fp8 else None
    spec = prefill_spec(_CTYPES[q.dtype], head_dim, cache_ctype)
    expr = prefill_expr(_CTYPES[q.dtype], head_dim, block_m, cache_ctype)
    args = (
        _ptr(q), _i64(q.stride(0)), _i64(q.stride(1)),
        _ptr(k_cache), _ptr(v_cache),
        _ptr(block_tables), _i64(block_tables.stride(0)),
        _ptr(seq_lens), _ptr(cu_seqlens_q),
        _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)),
        _i32(num_seqs), _i32(num_heads), _i32(num_kv_heads), _i32(block_size),
        _f32(scale * LOG2E), _f32(k_scale), _f32(v_scale),
        *_window_softcap(op, window, softcap), *tree, _sinks_arg(op, sinks, num_heads, q.device),
    )  # fmt: skip
    smem = prefill_smem_bytes(head_dim, block_m, fp8)
    launch._launch(spec, expr, grid, (32 * PREFILL_CONFIGS[block_m][0],), args, smem, q.device)
    return out


def _check_prefill_args(
    op: str, cu_seqlens_q: torch.Tensor, num_seqs: int, block_m: int, device: torch.device
) -> None:
    _check(op, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=device)
    _check_contiguous(op, "cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        _fail(op, f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; expected {num_seqs + 1}")
    if block_m not in PREFILL_CONFIGS:
        _fail(op, f"block_m={block_m} must be one of {tuple(PREFILL_CONFIGS)}")


def _tree_args(
    op: str,
    tree_bits: torch.Tensor | None,
    tree_start: torch.Tensor | None,
    num_tokens: int,
    num_seqs: int,
    window: int | None,
    device: torch.device,
) -> tuple[Any, Any]:
    """The prefill kernel's tree pointers (null pointers without a tree), checked."""
    if tree_bits is None and tree_start is None:
        return np.uint64(0), np.uint64(0)
    if tree_bits is None or tree_start is None:
        _fail(op, "tree_bits and tree_start come together")
    assert tree_bits is not None and tree_start is not None
    if window is not None:
        _fail(op, f"window={window} with a token tree: the kernel compares stored positions")
    _check(op, "tree_bits", tree_bits, ndim=1, dtypes=(torch.int64,), device=device)
    _check(op, "tree_start", tree_start, ndim=1, dtypes=(torch.int32,), device=device)
    _check_contiguous(op, "tree_bits", tree_bits)
    _check_contiguous(op, "tree_start", tree_start)
    if tree_bits.shape[0] < num_tokens or tree_start.shape[0] != num_seqs:
        _fail(op, f"tree_bits needs {num_tokens} entries and tree_start {num_seqs}")
    return _ptr(tree_bits), _ptr(tree_start)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    max_seqlen_q: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.paged_attention on the GPU. A batch of decodes only (max_seqlen_q == 1, or, when
    it is not given, one query row per request, assuming every request has at least one) runs
    the decode kernel with split-K; anything else runs the prefill kernel. The pool is q's
    dtype, or FP8 with k_scale / v_scale; window, softcap and sinks (float32) as the
    reference's."""
    num_seqs = seq_lens.shape[0]
    decode_only = max_seqlen_q == 1 if max_seqlen_q is not None else q.shape[0] == num_seqs
    if decode_only:
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
            max_seq_len=max_seq_len, out=out, window=window, softcap=softcap, sinks=sinks,
        )  # fmt: skip
    return paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, k_scale, v_scale,
        out=out, window=window, softcap=softcap, sinks=sinks,
    )  # fmt: skip
