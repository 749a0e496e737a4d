"""The batched LoRA kernels' wrapper (lora.cu), mirroring kernels/lora_reference.lora_add, with
the argument checks of kernels/launch.py."""

from __future__ import annotations

import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    _INDEX_CTYPES,
    ModuleSpec,
    _check,
    _check_contiguous,
    _check_rows16,
    _fail,
    _i32,
    _i64,
    _ptr,
)

LORA_WARPS = 4  # columns of h per shrink CTA (lora.cu's LORA_WARPS)
EXPAND_THREADS = 128  # lora.cu's LORA_EXPAND_THREADS, 8 columns each
MAX_PARTS = 3
MAX_GRID_Y = 65535


def lora_spec(ctype: str) -> ModuleSpec:
    exprs = [f"lora_shrink_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    exprs += [f"lora_expand_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("lora.cu", tuple(exprs))


def _check_lora_args(
    x: torch.Tensor,
    out: torch.Tensor,
    slot_ids: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    rank: int,
) -> list[int]:
    """Each part's output width once every argument is as lora.cu's header says; ValueError
    naming the argument otherwise."""
    op = "lora_add"
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    _check_rows16(op, "x", x)
    num_rows, in_features = x.shape
    _check(op, "out", out, ndim=2, dtypes=(x.dtype,), device=x.device, shape=(num_rows, None))
    _check_rows16(op, "out", out)
    _check(op, "slot_ids", slot_ids, ndim=1, dtypes=tuple(_INDEX_CTYPES), device=x.device,
           shape=(num_rows,))  # fmt: skip
    _check_contiguous(op, "slot_ids", slot_ids)
    _check(op, "a", a, ndim=4, dtypes=(x.dtype,), device=x.device,
           shape=(None, None, len(b), in_features))  # fmt: skip
    _check_contiguous(op, "a", a)
    num_slots, max_rank, _, _ = a.shape
    if not 1 <= len(b) <= MAX_PARTS:
        _fail(op, f"len(b)={len(b)}: a projection has 1 to {MAX_PARTS} parts")
    for p, bp in enumerate(b):
        _check(op, f"b[{p}]", bp, ndim=3, dtypes=(x.dtype,), device=x.device,
               shape=(num_slots, max_rank, None))  # fmt: skip
        _check_contiguous(op, f"b[{p}]", bp)
    widths = [bp.shape[2] for bp in b]
    if sum(widths) != out.shape[1]:
        _fail(op, f"out.shape[1]={out.shape[1]} must be the parts' widths' sum {sum(widths)}")
    if not 1 <= rank <= max_rank:
        _fail(op, f"rank={rank} must be in 1..{max_rank} (the tables' max_rank)")
    if in_features % 8 or any(w % 8 for w in widths):
        _fail(op, f"in={in_features} and every out_p {widths} must be multiples of 8")
    if num_slots == 0 or -(-len(b) * rank // LORA_WARPS) > MAX_GRID_Y:
        _fail(op, f"a.shape={tuple(a.shape)}: at least one slot, parts * rank <= 262140")
    return widths


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    slot_ids: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    rank: int,
) -> torch.Tensor:
    """lora_reference.lora_add: out[t] += B_s (A_s x[t]) per part, s = slot_ids[t] (rows whose
    id is outside 0 .. slots - 1 are left as they are); out updated in place and returned.
    x, out, a, b fp16 / bf16 alike; slot_ids int32 / int64 on the device. Never
    synchronizes."""
    widths = _check_lora_args(x, out, slot_ids, a, b, rank)
    num_rows = x.shape[0]
    if num_rows == 0:
        return out
    num_slots, max_rank, num_parts, in_features = a.shape
    h = torch.empty(num_rows, num_parts * rank, dtype=x.dtype, device=x.device)
    ctype, itype = _CTYPES[x.dtype], _INDEX_CTYPES[slot_ids.dtype]
    spec = lora_spec(ctype)
    shape = (_i32(num_slots), _i32(num_parts), _i32(max_rank), _i32(rank))
    args = (_ptr(x), _i64(x.stride(0)), _ptr(slot_ids), _ptr(a), _ptr(h), *shape,
            _i32(in_features))  # fmt: skip
    grid = (num_rows, -(-num_parts * rank // LORA_WARPS))
    launch._launch(spec, f"lora_shrink_kernel<{ctype}, {itype}>", grid, (128,), args, 0, x.device)
    pointers = [_ptr(bp) for bp in b] + [_ptr(b[0])] * (MAX_PARTS - num_parts)  # unread
    padded_widths = [*widths, *[0] * (MAX_PARTS - num_parts)]
    args = (_ptr(h), _ptr(slot_ids), *pointers, _ptr(out), _i64(out.stride(0)), *shape,
            *(_i32(w) for w in padded_widths))  # fmt: skip
    grid = (num_rows, -(-max(widths) // (8 * EXPAND_THREADS)), num_parts)
    expr = f"lora_expand_kernel<{ctype}, {itype}>"
    launch._launch(spec, expr, grid, (EXPAND_THREADS,), args, 0, x.device)
    return out
