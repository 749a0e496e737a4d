"""The torch reference of kernels/ssd_step.cu: one decode step of Mamba-2's selective state
space, the arithmetic of transformers' Mamba2Mixer.torch_forward with a cache (the SSM part:
the convolution before it and the gated norm after it are the model's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
    """x, out [rows, heads, head_dim]; dt [rows, heads] fp32 (before bias and softplus);
    dt_bias, a (= -exp(A_log)), d [heads] fp32; b, c [rows, groups, d_state]; state [slots,
    heads, head_dim, d_state] fp32 updated in place at slot_ids[row] (out-of-range slots
    skipped); out written in its dtype and returned."""
    heads, groups = x.shape[1], b.shape[1]
    xf = x.to(torch.float32)
    bf, cf = (t.to(torch.float32).repeat_interleave(heads // groups, dim=1) for t in (b, c))
    dtf = F.softplus(dt + dt_bias)  # [rows, heads]
    for row in range(x.shape[0]):
        slot = int(slot_ids[row])
        if not 0 <= slot < state.shape[0]:
            continue
        decay = torch.exp(dtf[row] * a)[:, None, None]
        dbx = dtf[row][:, None, None] * bf[row][:, None, :] * xf[row][:, :, None]
        s = state[slot] * decay + dbx
        state[slot] = s
        y = (s @ cf[row][:, :, None])[..., 0] + d[:, None] * xf[row]
        out[row] = y.to(out.dtype)
    return out
