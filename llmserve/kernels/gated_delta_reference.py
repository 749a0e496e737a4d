"""The torch reference of kernels/gated_delta.cu: one decode step of the gated delta rule
(Qwen3-Next's GatedDeltaNet), the same arithmetic as transformers'
torch_recurrent_gated_delta_rule for a sequence of length 1, over a slot-indexed state pool.

`delta_step` is the rule's one-token update itself, the only copy of it in the project: the
engine's recurrent and decode forms (engine/model/linear_attention.py) call it too."""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dimension, as transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the rule for any leading dims (...): q, k [..., dk] float32, q already
    scaled (and both normalised where the model does); v [..., dv]; g (log decay), beta [...];
    state [..., dk, dv] float32. Returns (out [..., dv], the new state); state is not changed.

        S <- S * exp(g);  S <- S + k (beta (v - k S));  out = q S"""
    s = state * g.float().exp()[..., None, None]
    mem = torch.einsum("...k,...kv->...v", k, s)
    delta = (v.float() - mem) * beta.float()[..., None]
    s = s + torch.einsum("...k,...v->...kv", k, delta)
    return torch.einsum("...k,...kv->...v", q, s), s


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
    """q, k [rows, heads, dk]; v, out [rows, heads, dv]; g (log decay), beta [rows, heads] fp32;
    state [slots, heads, dk, dv] fp32 updated in place at slot_ids[row] (rows whose slot is out
    of range are skipped); out written in its dtype and returned."""
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * q.shape[-1] ** -0.5
    slots = slot_ids.long()
    used = ((slots >= 0) & (slots < state.shape[0])).nonzero().flatten()
    if used.numel():
        at = slots[used]
        o, s = delta_step(qf[used], kf[used], v[used], g[used], beta[used], state[at])
        state[at] = s
        out[used] = o.to(out.dtype)
    return out


_l2norm = l2norm  # gated_delta_step's flag shadows the name
