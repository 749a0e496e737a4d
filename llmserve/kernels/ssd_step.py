"""Mamba-2's selective-state decode step's wrapper (ssd_step.cu), mirroring
kernels/ssd_step_reference.ssd_step, with the argument checks of kernels/launch.py."""

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

SSD_WARPS = 4  # ssd_step.cu's SSD_WARPS: channels per CTA
MAX_GRID_Y = 65535


def ssd_step_spec(ctype: str) -> ModuleSpec:
    exprs = [f"ssd_step_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("ssd_step.cu", tuple(exprs))


def _check_args(tensors: dict[str, torch.Tensor]) -> None:
    op = "ssd_step"
    x = tensors["x"]
    _check(op, "x", x, ndim=3, dtypes=tuple(_CTYPES))
    rows, heads, head_dim = x.shape
    dev, f32 = x.device, (torch.float32,)
    _check(op, "out", tensors["out"], ndim=3, dtypes=(x.dtype,), device=dev, shape=x.shape)
    _check(op, "dt", tensors["dt"], ndim=2, dtypes=f32, device=dev, shape=(rows, heads))
    for name in ("dt_bias", "a", "d"):
        _check(op, name, tensors[name], ndim=1, dtypes=f32, device=dev, shape=(heads,))
    b = tensors["b"]
    _check(op, "b", b, ndim=3, dtypes=(x.dtype,), device=dev, shape=(rows, None, None))
    _check(op, "c", tensors["c"], ndim=3, dtypes=(x.dtype,), device=dev, shape=b.shape)
    _check(op, "state", tensors["state"], ndim=4, dtypes=f32, device=dev,
           shape=(None, heads, head_dim, b.shape[2]))  # fmt: skip
    _check(op, "slot_ids", tensors["slot_ids"], ndim=1, dtypes=tuple(_INDEX_CTYPES),
           device=dev, shape=(rows,))  # fmt: skip
    for name, t in tensors.items():
        _check_contiguous(op, name, t)
    groups = b.shape[1]
    if groups == 0 or heads % groups:
        _fail(op, f"b.shape[1]={groups} (groups) must divide x.shape[1]={heads} (heads)")
    if head_dim == 0 or b.shape[2] == 0 or heads > MAX_GRID_Y or tensors["state"].shape[0] == 0:
        _fail(op, f"x.shape={tuple(x.shape)}, b.shape={tuple(b.shape)}: head_dim and d_state "
              f">= 1, heads <= {MAX_GRID_Y}, at least one state slot")  # fmt: skip


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """ssd_step_reference.ssd_step on the GPU: state updated in place at each row's slot, out
    written and returned. Never synchronizes."""
    names = ("x", "dt", "dt_bias", "a", "b", "c", "d", "state", "slot_ids", "out")
    tensors = dict(zip(names, (x, dt, dt_bias, a, b, c, d, state, slot_ids, out), strict=True))
    _check_args(tensors)
    rows, heads, head_dim = x.shape
    if rows == 0:
        return out
    ctype, itype = _CTYPES[x.dtype], _INDEX_CTYPES[slot_ids.dtype]
    sizes = (state.shape[0], heads, b.shape[1], head_dim, b.shape[2])
    args = (*(_ptr(t) for t in tensors.values()), *(_i32(n) for n in sizes))
    grid = (rows, heads, -(-head_dim // SSD_WARPS))
    expr = f"ssd_step_kernel<{ctype}, {itype}>"
    launch._launch(ssd_step_spec(ctype), expr, grid, (128,), args, 0, x.device)
    return out
