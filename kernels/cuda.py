"""The CUDA kernels of kernels/*.cu, compiled at run time by CuPy (NVRTC) and launched on torch
tensors' memory, on torch's current stream, without copies.

Each public function mirrors one in kernels/reference.py (the ground truth and the CPU path), but
takes its per-step metadata as device tensors: `seq_lens` and `cu_seqlens_q` int32, `block_tables`
int32, `slot_mapping` int32 or int64. Every function checks shapes, strides, dtypes and devices
before launching and raises ValueError naming the argument, its value and the limit.

Compiled modules are cached per configuration (source file, dtype, head_dim) and device; CuPy also
caches the binaries on disk (~/.cupy/kernel_cache), keyed by the source text, which is why
common.cu is inlined into each source here rather than #included through a path.

Importing this module needs neither CuPy nor a GPU; `is_available()` says whether the kernels can
run. KV pool layout (the one of kernels/reference.py): one layer's k_cache / v_cache are contiguous
`[num_blocks, block_size, num_kv_heads, head_dim]`; slot s is row s % block_size of block
s // block_size. The pool's dtype is q's (fp16 / bf16) or torch.float8_e4m3fn: an FP8 pool holds
K / k_scale and V / v_scale (per-layer floats, vLLM's k_scale / v_scale; see reference.py), which
store_kv quantizes (round to nearest even, saturating to +-448) and the attention kernels convert
back to q's dtype on load, applying the scales in fp32. Each cache dtype is its own compiled
template instance, so the fp16 / bf16 pool's kernels do exactly what they did before FP8.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.reference import FP8_DTYPE, check_kv_scales

KERNEL_DIR = Path(__file__).resolve().parent
# No --use_fast_math: exp2f / expf / rsqrtf / division keep their accurate forms.
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
HEAD_DIMS = (64, 128)
DECODE_TILE = 16  # tokens per warp step in decode_attention.cu; block_size must be a multiple
DECODE_THREADS = 128
# prefill_attention.cu instances by rows per CTA: (warps, 16-row m-tiles per warp, keys per tile)
PREFILL_CONFIGS: dict[int, tuple[int, int, int]] = {64: (4, 1, 64), 128: (4, 2, 32)}
PREFILL_DEFAULT_BLOCK_M = 128
DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory
LOG2E = 1.4426950408889634

_CTYPES = {torch.float16: "f16_t", torch.bfloat16: "bf16_t"}
FP8_CTYPE = "fp8e4m3_t"  # common.cu's type for a torch.float8_e4m3fn pool
_INDEX_CTYPES = {torch.int32: "int", torch.int64: "long long"}
# Resident CTAs per SM of paged_decode_kernel on sm_90, from `nvcc -Xptxas -v` (registers with
# __launch_bounds__(128, 3): 168 for head_dim 128, 124 for 64) and its shared memory.
_DECODE_CTAS_PER_SM = {64: 4, 128: 3}


@dataclass(frozen=True)
class ModuleSpec:
    """One compiled unit: a .cu file and the template instances taken from it."""

    filename: str
    name_expressions: tuple[str, ...]


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


def layer_ops_spec(ctype: str) -> ModuleSpec:
    exprs = [f"rms_norm_kernel<{ctype}>", f"silu_and_mul_kernel<{ctype}>"]
    exprs += [f"rotary_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("layer_ops.cu", tuple(exprs))


def all_module_specs() -> list[ModuleSpec]:
    """Every configuration the wrappers below can launch (the compile test builds each)."""
    specs = [store_kv_spec()]
    for ctype in _CTYPES.values():
        specs += [decode_spec(ctype, d) for d in HEAD_DIMS]
        specs += [prefill_spec(ctype, d) for d in HEAD_DIMS]
        specs.append(layer_ops_spec(ctype))
    for ctype in _CTYPES.values():
        specs.append(store_kv_spec(ctype))
        specs += [decode_spec(ctype, d, FP8_CTYPE) for d in HEAD_DIMS]
        specs += [prefill_spec(ctype, d, FP8_CTYPE) for d in HEAD_DIMS]
    return specs


def load_source(filename: str) -> str:
    """The text of kernels/<filename> with `#include "common.cu"` replaced by that file."""
    text = (KERNEL_DIR / filename).read_text()
    common = (KERNEL_DIR / "common.cu").read_text()
    return text.replace('#include "common.cu"', common, 1)


def is_available() -> bool:
    """True when CuPy imports and torch sees a CUDA device of compute capability 8.0 or newer."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


# ---------------------------------------------------------------------------------------------
# Compilation, caching and launching


@cache
def _module(spec: ModuleSpec, device_index: int) -> Any:
    import cupy  # type: ignore[import-not-found, unused-ignore]

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(
            code=load_source(spec.filename),
            options=NVRTC_OPTIONS,
            name_expressions=list(spec.name_expressions),
        )


@cache
def _kernel(spec: ModuleSpec, expr: str, device_index: int) -> Any:
    """Called inside `cupy.cuda.Device(device_index)`."""
    kernel = _module(spec, device_index).get_function(expr)
    kernel.max_dynamic_shared_size_bytes = DEFAULT_SMEM_LIMIT
    return kernel


class _TorchStream:
    """A raw stream handle with the CUDA stream protocol (`__cuda_stream__` -> (version 0,
    handle)), which CuPy 14's `Stream.from_external` takes in place of a pointer."""

    def __init__(self, stream_ptr: int):
        self.stream_ptr = stream_ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.stream_ptr)


@lru_cache(maxsize=64)
def _external_stream(stream_ptr: int, device_index: int) -> Any:
    import cupy

    # CuPy 14 deprecates ExternalStream(ptr, device) for Stream.from_external(obj), obj being
    # anything with the CUDA stream protocol; older CuPy has only the former.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(stream_ptr, device_index)
    return from_external(_TorchStream(stream_ptr))


def _launch(
    spec: ModuleSpec,
    expr: str,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    smem: int,
    device: torch.device,
) -> None:
    """Launch `expr` of `spec` on torch's current stream of `device`. The one place that touches
    CuPy's launch API (the CPU emulation used while writing these kernels replaces it)."""
    import cupy

    stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        kernel = _kernel(spec, expr, device.index)
        if smem > kernel.max_dynamic_shared_size_bytes:
            kernel.max_dynamic_shared_size_bytes = smem
        kernel(grid, block, args, shared_mem=smem, stream=stream)


@lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _i32(value: int) -> np.int32:
    return np.int32(value)


def _i64(value: int) -> np.int64:
    return np.int64(value)


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


# ---------------------------------------------------------------------------------------------
# Argument checks (before anything is compiled or launched)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _require_cuda(op: str, name: str, t: torch.Tensor, device: torch.device | None) -> None:
    if t.device.type != "cuda":
        _fail(op, f"{name} is on {t.device}; the CUDA kernels need tensors on a CUDA device")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device} but the other tensors are on {device}")


def _check(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(op, f"{name}.dtype={t.dtype} is not supported; expected {allowed}")
    _require_cuda(op, name, t, device)
    if shape is not None:
        for dim, (got, want) in enumerate(zip(t.shape, shape, strict=True)):
            if want is not None and got != want:
                _fail(op, f"{name}.shape[{dim}]={got} must be {want} (shape {tuple(t.shape)})")


def _check_rows16(op: str, name: str, t: torch.Tensor) -> None:
    """Last dim contiguous, every row start 16-byte aligned (the kernels move 16-byte vectors)."""
    if t.numel() == 0:
        return
    if t.stride(-1) != 1:
        _fail(op, f"{name} needs a contiguous last dimension, got strides {t.stride()}")
    elem = t.element_size()
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and (t.stride(dim) * elem) % 16:
            _fail(op, f"{name}.stride({dim})={t.stride(dim)} must be a multiple of {16 // elem}")
    if t.data_ptr() % 16:
        _fail(op, f"{name} must start on a 16-byte boundary (data_ptr % 16 = {t.data_ptr() % 16})")


def _check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


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


def _output(
    op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check(op, "out", out, ndim=len(shape), dtypes=(like.dtype,), device=like.device, shape=shape)
    _check_rows16(op, "out", out)
    return out


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
    _launch(spec, expr, (-(-threads // 256),), (256,), args, 0, key.device)


def decode_smem_bytes(head_dim: int, fp8: bool = False) -> int:
    """4 warps x 2 stages x (K + V) x 16 rows x (head_dim + 8) x 2 bytes; with an FP8 cache,
    4 warps x (2 stages x (K + V) x 16 rows x head_dim bytes + one T tile of K and V)."""
    tile = 2 * DECODE_TILE * (head_dim + 8) * 2
    if fp8:
        return 4 * (2 * 2 * DECODE_TILE * head_dim + tile)
    return 4 * 2 * tile


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
) -> torch.Tensor:
    """One query per sequence over its context in the paged pool (reference.paged_attention with
    cu_seqlens_q = arange(num_seqs + 1)). The pool is q's dtype, or FP8 with k_scale / v_scale.

    q: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, >= ceil(seq_len / block_size)]
    int32; seq_lens: [num_seqs] int32, the context length including this step's token (already
    stored). block_size must be a multiple of 16. Returns [num_seqs, num_heads, head_dim] in q's
    dtype (written into `out` when given); a sequence with seq_len 0 gets zeros.

    num_splits (split-K): chosen from max_seq_len and the GPU's size when not given. Without
    max_seq_len it is read from seq_lens, which synchronizes with the device: CUDA-graph callers
    pass both, fixed per captured batch size.
    """
    op = "paged_decode_attention"
    num_seqs = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1
    num_heads, num_kv_heads, head_dim, block_size = _check_attention_args(
        op, q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale
    )
    if seq_lens.shape[0] != num_seqs:
        _fail(op, f"seq_lens has {seq_lens.shape[0]} entries for {num_seqs} sequences")
    if block_size % DECODE_TILE:
        _fail(op, f"block_size={block_size} must be a multiple of {DECODE_TILE}")
    out = _output(op, out, (num_seqs, num_heads, head_dim), q)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    num_ctas = num_kv_heads * -(-group // 16) * num_seqs
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        slots = _num_sms(q.device) * _DECODE_CTAS_PER_SM[head_dim]
        num_splits = decode_num_splits(num_ctas, max_seq_len, slots)
    if not 1 <= num_splits <= 65535:
        _fail(op, f"num_splits={num_splits} must be in [1, 65535]")

    ctype = _CTYPES[q.dtype]
    fp8 = k_cache.dtype == FP8_DTYPE
    spec = decode_spec(ctype, head_dim, FP8_CTYPE if fp8 else None)
    if num_splits > 1:
        parts = (num_splits, num_seqs, num_heads)
        part_acc = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((*parts, 2), dtype=torch.float32, device=q.device)
        part_args = (_ptr(part_acc), _ptr(part_ml))
    else:
        part_args = (np.uint64(0), np.uint64(0))
    smem = decode_smem_bytes(head_dim, fp8)
    args = (
        _ptr(q), _i64(q.stride(0)), _i64(q.stride(1)),
        _ptr(k_cache), _ptr(v_cache),
        _ptr(block_tables), _i64(block_tables.stride(0)), _ptr(seq_lens),
        _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)),
        *part_args,
        _i32(num_seqs), _i32(num_heads), _i32(num_kv_heads), _i32(block_size),
        _f32(scale * LOG2E), _i32(num_splits), _f32(k_scale), _f32(v_scale),
    )  # fmt: skip
    grid = (num_ctas // num_seqs, num_seqs, num_splits)
    _launch(spec, spec.name_expressions[0], grid, (DECODE_THREADS,), args, smem, q.device)
    if num_splits > 1:
        merge_args = (
            *part_args, _ptr(seq_lens),
            _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)),
            _i32(num_seqs), _i32(num_heads), _i32(num_splits),
        )  # fmt: skip
        merge_grid = (num_heads, num_seqs)
        _launch(spec, spec.name_expressions[1], merge_grid, (head_dim,), merge_args, 0, q.device)
    return out


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
) -> torch.Tensor:
    """Causal attention of each request's new queries over its whole context in the paged pool:
    reference.paged_attention with device metadata. The pool is q's dtype, or FP8 with k_scale /
    v_scale.

    q: [T, num_heads, head_dim], requests one after another; cu_seqlens_q: [num_seqs + 1] int32
    offsets into q (cu_seqlens_q[-1] <= T); seq_lens: [num_seqs] int32 context lengths including
    this step's tokens, whose K/V must already be stored; block_tables: [num_seqs, >=
    ceil(seq_len / block_size)] int32. Any block_size. Needs no host-side metadata (graph-safe).
    Returns [T, num_heads, head_dim] in q's dtype (rows past cu_seqlens_q[-1] are not written).
    block_m: (query token, head) rows per CTA, a key of PREFILL_CONFIGS.
    """
    op = "paged_prefill_attention"
    num_seqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    num_heads, num_kv_heads, head_dim, block_size = _check_attention_args(
        op, q, k_cache, v_cache, block_tables, seq_lens, num_seqs, k_scale, v_scale
    )
    _check(op, "cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,), device=q.device)
    _check_contiguous(op, "cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        _fail(op, f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries; expected {num_seqs + 1}")
    if block_m not in PREFILL_CONFIGS:
        _fail(op, f"block_m={block_m} must be one of {tuple(PREFILL_CONFIGS)}")
    num_tokens = q.shape[0]
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
    )  # fmt: skip
    smem = prefill_smem_bytes(head_dim, block_m, fp8)
    _launch(spec, expr, grid, (32 * PREFILL_CONFIGS[block_m][0],), args, smem, q.device)
    return out


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
) -> torch.Tensor:
    """reference.paged_attention on the GPU. A batch of decodes only (max_seqlen_q == 1, or, when
    it is not given, one query row per request, assuming every request has at least one) runs
    the decode kernel with split-K; anything else runs the prefill kernel. The pool is q's
    dtype, or FP8 with k_scale / v_scale."""
    num_seqs = seq_lens.shape[0]
    decode_only = max_seqlen_q == 1 if max_seqlen_q is not None else q.shape[0] == num_seqs
    if decode_only:
        return paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale,
            max_seq_len=max_seq_len, out=out,
        )  # fmt: skip
    return paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale, k_scale, v_scale,
        out=out,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.rms_norm: (x + residual) normalized by its RMS, times weight; returns
    (out, new residual). x, residual: [T, hidden]; the new residual is written to `residual_out`
    (a new tensor by default; it may be `residual` itself). Without a residual it is x."""
    op = "rms_norm"
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    num_tokens, hidden = x.shape
    _check_rows16(op, "x", x)
    _check(op, "weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device, shape=(hidden,))
    _check_contiguous(op, "weight", weight)
    _check_rows16(op, "weight", weight)
    if hidden % 8 or hidden > 24576:
        _fail(op, f"hidden={hidden} must be a multiple of 8 and at most 24576")
    out = _output(op, out, (num_tokens, hidden), x)
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        for name, t in (("residual", residual), ("residual_out", residual_out)):
            _check(op, name, t, ndim=2, dtypes=(x.dtype,), device=x.device,
                   shape=(num_tokens, hidden))  # fmt: skip
            _check_rows16(op, name, t)
        res_args = (_ptr(residual), _i64(residual.stride(0)))
        res_out_args = (_ptr(residual_out), _i64(residual_out.stride(0)))
    else:
        residual_out = x
        res_args = (np.uint64(0), _i64(0))
        res_out_args = (np.uint64(0), _i64(0))
    if num_tokens == 0:
        return out, residual_out
    args = (
        _ptr(x), _i64(x.stride(0)), *res_args, _ptr(weight),
        _ptr(out), _i64(out.stride(0)), *res_out_args,
        _i32(hidden), _f32(eps),
    )  # fmt: skip
    threads = min(1024, -(-(hidden // 8) // 32) * 32)
    spec = layer_ops_spec(_CTYPES[x.dtype])
    _launch(spec, spec.name_expressions[0], (num_tokens,), (threads,), args, hidden * 2, x.device)
    return out, residual_out


def rotary_embedding(
    positions: torch.Tensor,
    x: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.rotary_embedding: rotate x ([T, heads, head_dim], NeoX pairing (i, i + d/2)) by
    position. cos_sin_cache: [max_position, head_dim] float32 = cat(cos, sin). `out` may be x
    itself (in place). Positions must be < max_position (not checked: that would sync)."""
    op = "rotary_embedding"
    _check(op, "x", x, ndim=3, dtypes=tuple(_CTYPES))
    num_tokens, num_heads, head_dim = x.shape
    _check_rows16(op, "x", x)
    _check(op, "positions", positions, ndim=1, dtypes=tuple(_INDEX_CTYPES), device=x.device,
           shape=(num_tokens,))  # fmt: skip
    _check_contiguous(op, "positions", positions)
    _check(op, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32,), device=x.device,
           shape=(None, head_dim))  # fmt: skip
    _check_contiguous(op, "cos_sin_cache", cos_sin_cache)
    _check_rows16(op, "cos_sin_cache", cos_sin_cache)
    if head_dim % 16:
        _fail(op, f"head_dim={head_dim} must be a multiple of 16")
    out = _output(op, out, (num_tokens, num_heads, head_dim), x)
    threads = num_tokens * num_heads * head_dim // 16
    if threads == 0:
        return out
    args = (
        _ptr(positions), _ptr(x), _i64(x.stride(0)), _i64(x.stride(1)),
        _ptr(out), _i64(out.stride(0)), _i64(out.stride(1)), _ptr(cos_sin_cache),
        _i32(num_tokens), _i32(num_heads), _i32(head_dim),
    )  # fmt: skip
    spec = layer_ops_spec(_CTYPES[x.dtype])
    expr = f"rotary_kernel<{_CTYPES[x.dtype]}, {_INDEX_CTYPES[positions.dtype]}>"
    _launch(spec, expr, (-(-threads // 256),), (256,), args, 0, x.device)
    return out


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """reference.silu_and_mul: x = [gate | up] ([T, 2d]) -> silu(gate) * up ([T, d])."""
    op = "silu_and_mul"
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    num_tokens, width = x.shape
    _check_rows16(op, "x", x)
    if width % 16:
        _fail(op, f"x.shape[1]={width} must be a multiple of 16 (2 x a multiple of 8)")
    d = width // 2
    out = _output(op, out, (num_tokens, d), x)
    threads = num_tokens * d // 8
    if threads == 0:
        return out
    args = (_ptr(x), _i64(x.stride(0)), _ptr(out), _i64(out.stride(0)), _i32(num_tokens), _i32(d))
    spec = layer_ops_spec(_CTYPES[x.dtype])
    _launch(spec, spec.name_expressions[1], (-(-threads // 256),), (256,), args, 0, x.device)
    return out
