"""The MLA decode kernel's wrapper (mla_decode.cu), mirroring kernels/reference.py's
mla_decode_attention, with the argument checks of kernels/launch.py."""

from __future__ import annotations

import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    ModuleSpec,
    _check,
    _check_contiguous,
    _f32,
    _fail,
    _i32,
    _i64,
    _output,
    _ptr,
)

MLA_HEADS = 16  # query heads per CTA (mla_decode.cu's MLA_HEADS)
MLA_TILE = 16  # tokens per shared-memory tile
MLA_THREADS = 128
MLA_DPT = (1, 2, 4)  # output dims per thread the module is built for: kv_lora_rank <= 512
MAX_GRID_Y = 65535
LOG2E = 1.4426950408889634


def mla_spec(ctype: str) -> ModuleSpec:
    return ModuleSpec("mla_decode.cu", tuple(f"mla_decode_kernel<{ctype}, {d}>" for d in MLA_DPT))


def mla_smem_bytes(dim: int) -> int:
    """q (16 rows of dim) and one tile (16 rows of dim + 2) of 2-byte elements, then 16 x 16
    probabilities and 3 x 16 softmax floats (mla_decode.cu's header)."""
    return (MLA_HEADS * dim + MLA_TILE * (dim + 2)) * 2 + (MLA_HEADS * MLA_TILE + 3 * MLA_HEADS) * 4


def mla_dims_per_thread(kv_lora_rank: int) -> int:
    """The smallest built DPT with 128 * DPT >= kv_lora_rank."""
    for dpt in MLA_DPT:
        if kv_lora_rank <= MLA_THREADS * dpt:
            return dpt
    limit = MLA_THREADS * MLA_DPT[-1]
    raise ValueError(f"mla_decode_attention: kv_lora_rank={kv_lora_rank} exceeds {limit}")


def _check_mla_args(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    op = "mla_decode_attention"
    _check(op, "q", q, ndim=3, dtypes=tuple(_CTYPES))
    num_seqs, _, dim = q.shape
    if q.stride(-1) != 1 or q.stride(0) % 2 or q.stride(1) % 2 or q.data_ptr() % 4:
        _fail(op, f"q needs a contiguous last dimension, even strides and 4-byte alignment, "
              f"got strides {q.stride()}")  # fmt: skip
    if not 0 < kv_lora_rank < dim or dim % 2:
        _fail(op, f"kv_lora_rank={kv_lora_rank} must be in 1..{dim - 1} and q.shape[2]={dim} "
              "(kv_lora_rank + rope_dim) even")  # fmt: skip
    _check(op, "latent_cache", latent_cache, ndim=4, dtypes=(q.dtype,), device=q.device,
           shape=(None, None, 1, dim))  # fmt: skip
    _check_contiguous(op, "latent_cache", latent_cache)
    _check(op, "block_tables", block_tables, ndim=2, dtypes=(torch.int32,), device=q.device,
           shape=(num_seqs, None))  # fmt: skip
    if block_tables.stride(1) != 1:
        _fail(op, f"block_tables needs a contiguous last dimension, got {block_tables.stride()}")
    _check(op, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,), device=q.device,
           shape=(num_seqs,))  # fmt: skip
    _check_contiguous(op, "seq_lens", seq_lens)
    if num_seqs > MAX_GRID_Y:
        _fail(op, f"q.shape[0]={num_seqs} sequences exceed the grid's {MAX_GRID_Y}")


def mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """reference.mla_decode_attention on the GPU: [num_seqs, num_heads, kv_lora_rank] in q's
    dtype; seq_lens an int32 tensor on the device (the reference takes a list). Never
    synchronizes."""
    _check_mla_args(q, latent_cache, block_tables, seq_lens, kv_lora_rank)
    num_seqs, num_heads, dim = q.shape
    dpt = mla_dims_per_thread(kv_lora_rank)
    out = _output("mla_decode_attention", out, (num_seqs, num_heads, kv_lora_rank), q)
    if num_seqs == 0 or num_heads == 0:
        return out
    ctype = _CTYPES[q.dtype]
    args = (
        _ptr(q), _i64(q.stride(0)), _i64(q.stride(1)), _ptr(latent_cache), _ptr(block_tables),
        _i64(block_tables.stride(0)), _ptr(seq_lens), _ptr(out), _i64(out.stride(0)),
        _i64(out.stride(1)), _i32(num_heads), _i32(kv_lora_rank), _i32(dim),
        _i32(latent_cache.shape[1]), _f32(scale * LOG2E),
    )  # fmt: skip
    grid = (-(-num_heads // MLA_HEADS), num_seqs)
    launch._launch(
        mla_spec(ctype), f"mla_decode_kernel<{ctype}, {dpt}>", grid, (MLA_THREADS,), args,
        mla_smem_bytes(dim), q.device,
    )  # fmt: skip
    return out
