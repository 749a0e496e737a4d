"""The per-token layer ops' wrappers (layer_ops.cu): fused RMSNorm (+ residual add), rotary
embedding and SiLU-and-mul, each mirroring kernels/reference.py, with the argument checks of
kernels/launch.py."""

from __future__ import annotations

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


def layer_ops_spec(ctype: str) -> ModuleSpec:
    exprs = [f"rms_norm_kernel<{ctype}>", f"silu_and_mul_kernel<{ctype}>"]
    exprs += [f"rotary_kernel<{ctype}, {c}>" for c in _INDEX_CTYPES.values()]
    return ModuleSpec("layer_ops.cu", tuple(exprs))


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
    launch._launch(
        spec, spec.name_expressions[0], (num_tokens,), (threads,), args, hidden * 2, x.device
    )
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
    launch._launch(spec, expr, (-(-threads // 256),), (256,), args, 0, x.device)
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
    launch._launch(spec, spec.name_expressions[1], (-(-threads // 256),), (256,), args, 0, x.device)
    return out
