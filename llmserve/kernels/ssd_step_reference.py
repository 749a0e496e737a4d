"""The torch reference of kernels/ssd_step.cu: one decode step of Mamba-2's selective state
space per row, in place on a slot-indexed state pool (transformers' Mamba2Mixer arithmetic).
`ssd_update` is the one token's recurrence, written once: engine/model/mamba2.py's `recurrent`
(the CPU decode and the check of the chunked prefill form) runs it token by token. The
convolution before it and the gated norm after it are the model's."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of one sequence, float32: x [H, P]; dt [H] (after bias, softplus and limits);
    a (= -exp(A_log)), d [H]; b, c [G, N] (head h reads group h // (H / G)); state [H, P, N].
    Any leading dimensions before these (a batch of rows: x [R, H, P], ...) run together.

        S <- exp(dt A) S + dt x B^T;   y = S C + D x

    Returns (y [H, P], the new state)."""
    heads = x.shape[-2]
    bh, ch = (t.float().repeat_interleave(heads // t.shape[-2], dim=-2) for t in (b, c))
    xf, dtf = x.float(), dt.float()
    decay = torch.exp(dtf * a.float())[..., None, None]
    s = state.float() * decay  # a new tensor: the outer product is added into it in place
    p, n = s.shape[-2:]
    dtx = (dtf[..., None] * xf).reshape(-1, p, 1)
    s.view(-1, p, n).baddbmm_(dtx, bh.reshape(-1, 1, n))
    y = (s @ ch[..., None])[..., 0] + d.float()[:, None] * xf
    return y, s


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
    dtf = F.softplus(dt + dt_bias)  # [rows, heads]
    for row in range(x.shape[0]):
        slot = int(slot_ids[row])
        if not 0 <= slot < state.shape[0]:
            continue
        y, state[slot] = ssd_update(x[row], dtf[row], a, b[row], c[row], d, state[slot])
        out[row] = y.to(out.dtype)
    return out
