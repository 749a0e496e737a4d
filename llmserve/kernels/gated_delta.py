"""The gated delta-rule decode step's wrapper (gated_delta.cu), mirroring
kernels/gated_delta_reference.gated_delta_step, with the argument checks of kernels/launch.py."""

from __future__ import annotations

import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    _INDEX_CTYPES,
    ModuleSpec,
    _check,
    _check_contiguous,
    _fail,
    _i32,
    _ptr,
)

GDN_THREADS = 128  # gated_delta.cu's GDN_THREADS: value channels per CTA
GDN_MAX_DK = 256
MAX_GRID_Y = 65535


def gated_delta_spec(ctype: str) -> ModuleSpec:
    exprs = [f"gated_delta_step_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("gated_delta.cu", tuple(exprs))


def _check_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
) -> None:
    op = "gated_delta_step"
    _check(op, "q", q, ndim=3, dtypes=tuple(_CTYPES))
    rows, heads, dk = q.shape
    dev = q.device
    _check(op, "k", k, ndim=3, dtypes=(q.dtype,), device=dev, shape=(rows, heads, dk))
    _check(op, "v", v, ndim=3, dtypes=(q.dtype,), device=dev, shape=(rows, heads, None))
    dv = v.shape[2]
    _check(op, "out", out, ndim=3, dtypes=(q.dtype,), device=dev, shape=(rows, heads, dv))
    for name, t in (("g", g), ("beta", beta)):
        _check(op, name, t, ndim=2, dtypes=(torch.float32,), device=dev, shape=(rows, heads))
    _check(op, "state", state, ndim=4, dtypes=(torch.float32,), device=dev,
           shape=(None, heads, dk, dv))  # fmt: skip
    _check(op, "slot_ids", slot_ids, ndim=1, dtypes=tuple(_INDEX_CTYPES), device=dev,
           shape=(rows,))  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("g", g), ("beta", beta),
                    ("state", state), ("slot_ids", slot_ids)):  # fmt: skip
        _check_contiguous(op, name, t)
    if not 1 <= dk <= GDN_MAX_DK:
        _fail(op, f"q.shape[2]={dk} (dk) must be in 1..{GDN_MAX_DK}")
    if dv < 1 or heads > MAX_GRID_Y or state.shape[0] == 0:
        _fail(op, f"v.shape={tuple(v.shape)}, state.shape={tuple(state.shape)}: dv >= 1, "
              f"heads <= {MAX_GRID_Y}, at least one slot")  # fmt: skip


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
    l2norm: bool = True,
) -> torch.Tensor:
    """gated_delta_reference.gated_delta_step on the GPU: state updated in place at each row's
    slot, out written and returned. Never synchronizes."""
    _check_args(q, k, v, g, beta, state, slot_ids, out)
    rows, heads, dk = q.shape
    dv = v.shape[2]
    if rows == 0:
        return out
    ctype, itype = _CTYPES[q.dtype], _INDEX_CTYPES[slot_ids.dtype]
    pointers = (_ptr(q), _ptr(k), _ptr(v), _ptr(g), _ptr(beta), _ptr(state), _ptr(slot_ids))
    sizes = (_i32(state.shape[0]), _i32(heads), _i32(dk), _i32(dv), _i32(int(l2norm)))
    args = (*pointers, _ptr(out), *sizes)
    grid = (rows, heads, -(-dv // GDN_THREADS))
    expr = f"gated_delta_step_kernel<{ctype}, {itype}>"
    launch._launch(gated_delta_spec(ctype), expr, grid, (GDN_THREADS,), args, 0, q.device)
    return out
