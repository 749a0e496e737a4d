"""Plain-torch twins of kernels/w4a16_gemm.cu and kernels/fp8_block_gemm.cu (the tests' ground
truth): the weight dequantized to float32, then one matmul. `fp8_block_linear_reference` can also
quantize x per token-group of 128 first, as DeepSeek-V3's FP8 recipe (and torch._scaled_mm's
blockwise path, kernels/fp8_block.py) does."""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def dequantize_groups(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int
) -> torch.Tensor:
    """float32 W [N, K] = (q - zero) * scale, scale and zero [N, ceil(K / group)] (zero None: 0);
    q integers or float8_e4m3fn."""
    k = q.shape[1]
    s = scale.float().repeat_interleave(group, dim=1)[:, :k]
    w = q.float()
    if zero is not None:
        w = w - zero.float().repeat_interleave(group, dim=1)[:, :k]
    return w * s


def w4a16_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x W^T in float64 for q [N, K] in `perm` column order (column j reads x[:, perm[j]])."""
    w = dequantize_groups(q, scale, zero, group).double()
    xs = x.double() if perm is None else x.double()[:, perm]
    return xs @ w.t()


def quantize_token_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % group == 0) -> (e4m3 [M, K], float32 scales [M, K / group]): each row's
    group of `group` values divided by its largest magnitude / 448 (DeepSeek-V3's act_quant)."""
    m, k = x.shape
    groups = x.float().reshape(m, k // group, group)
    scales = groups.abs().amax(dim=2).clamp_min(1e-12) / E4M3_MAX
    q = (groups / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(m, k), scales


def fp8_block_linear_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    group: int,
    *,
    quantize_x: bool = False,
) -> torch.Tensor:
    """y = x W^T in float64, W = e4m3 q [N, K] times scale [N, ceil(K / group)]; quantize_x: x
    first rounded to e4m3 per token-group of 128 (the scaled_mm path's arithmetic)."""
    w = dequantize_groups(q, scale, None, group).double()
    if quantize_x:
        xq, xs = quantize_token_groups(x)
        x = (xq.double().reshape(xs.shape[0], xs.shape[1], -1) * xs.double()[..., None]).flatten(1)
    return x.double() @ w.t()
