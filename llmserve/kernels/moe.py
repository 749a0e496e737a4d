"""The routed experts' wrapper (moe.cu), mirroring kernels/moe_reference.moe_experts, with the
argument checks of kernels/launch.py."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    _INDEX_CTYPES,
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
from llmserve.kernels.moe_reference import ClampedSwiGLU

MOE_WARPS = 4  # rows per CTA (moe.cu's MOE_WARPS)
MAX_GRID_Y = 65535


def moe_spec(ctype: str) -> ModuleSpec:
    exprs = [f"moe_gate_up_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    exprs += [f"moe_down_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("moe.cu", tuple(exprs))


def _check_moe_args(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int,
) -> tuple[int, int]:
    """(hidden, inter) once every argument is as moe.cu's header says; ValueError otherwise."""
    op = "moe_experts"
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    _check_rows16(op, "x", x)
    num_tokens, hidden = x.shape
    _check(op, "ids", ids, ndim=2, dtypes=tuple(_INDEX_CTYPES), device=x.device,
           shape=(num_tokens, None))  # fmt: skip
    _check_contiguous(op, "ids", ids)
    top_k = ids.shape[1]
    _check(op, "weights", weights, ndim=2, dtypes=(torch.float32,), device=x.device,
           shape=(num_tokens, top_k))  # fmt: skip
    _check_contiguous(op, "weights", weights)
    _check(op, "w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device, shape=(None, None, hidden))
    _check_contiguous(op, "w13", w13)
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    if w13.shape[1] % 2 or num_local == 0:
        _fail(op, f"w13.shape={tuple(w13.shape)} must be [experts >= 1, 2 * inter, hidden]")
    _check(op, "w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device,
           shape=(num_local, hidden, inter))  # fmt: skip
    _check_contiguous(op, "w2", w2)
    if hidden % 8 or inter % 8:
        _fail(op, f"hidden={hidden} and inter={inter} must be multiples of 8")
    if max(hidden, inter) > MAX_GRID_Y * MOE_WARPS:
        _fail(op, f"hidden={hidden} and inter={inter} must be at most {MAX_GRID_Y * MOE_WARPS}")
    if first_expert < 0:
        _fail(op, f"first_expert={first_expert} must be >= 0")
    return hidden, inter


def _oss_args(
    oss: ClampedSwiGLU | None, num_local: int, hidden: int, inter: int, x: torch.Tensor
) -> tuple[Any, ...]:
    """(b13 pointer, alpha, limit, b2 pointer): null pointers without gpt-oss's extras."""
    if oss is None:
        return np.uint64(0), _f32(0.0), _f32(0.0), np.uint64(0)
    op = "moe_experts"
    for name, bias, shape in (
        ("b13", oss.b13, (num_local, 2 * inter)),
        ("b2", oss.b2, (num_local, hidden)),
    ):
        _check(op, name, bias, ndim=2, dtypes=(x.dtype,), device=x.device, shape=shape)
        _check_contiguous(op, name, bias)
    if not oss.limit > 0:
        _fail(op, f"the SwiGLU limit={oss.limit} must be positive")
    return _ptr(oss.b13), _f32(oss.alpha), _f32(oss.limit), _ptr(oss.b2)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
    oss: ClampedSwiGLU | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """moe_reference.moe_experts: for each token, the sum over its top-k pairs whose expert is
    local (first_expert .. first_expert + w13.shape[0] - 1) of weights * expert(x), [T, H] in
    x's dtype. x fp16 / bf16 [T, H]; ids int32 / int64 and weights float32 [T, k]; w13
    [E_local, 2 I, H], w2 [E_local, H, I] in x's dtype. oss: gpt-oss's biases (x's dtype,
    contiguous) and clamped SwiGLU. Never synchronizes."""
    hidden, inter = _check_moe_args(x, weights, ids, w13, w2, first_expert)
    extras = _oss_args(oss, w13.shape[0], hidden, inter, x)
    num_tokens, top_k = ids.shape
    out = _output("moe_experts", out, (num_tokens, hidden), x)
    if num_tokens == 0 or top_k == 0:
        return out
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    ctype, itype = _CTYPES[x.dtype], _INDEX_CTYPES[ids.dtype]
    spec = moe_spec(ctype)
    common = (_i32(top_k), _i32(first_expert), _i32(w13.shape[0]), _i32(hidden), _i32(inter))
    args = (_ptr(x), _i64(x.stride(0)), _ptr(ids), _ptr(w13), _ptr(h), *common, *extras[:3])
    grid = (num_tokens * top_k, -(-inter // MOE_WARPS))
    launch._launch(spec, f"moe_gate_up_kernel<{ctype}, {itype}>", grid, (128,), args, 0, x.device)
    args = (_ptr(h), _ptr(ids), _ptr(weights), _ptr(w2), _ptr(out), _i64(out.stride(0)), *common,
            extras[3])  # fmt: skip
    grid = (num_tokens, -(-hidden // MOE_WARPS))
    launch._launch(spec, f"moe_down_kernel<{ctype}, {itype}>", grid, (128,), args, 0, x.device)
    return out
