"""The torch reference of kernels/gated_delta.cu: one decode step of the gated delta rule
(Qwen3-Next's GatedDeltaNet), the same arithmetic as transformers'
torch_recurrent_gated_delta_rule for a sequence of length 1, over a slot-indexed state pool."""

from __future__ import annotations

import torch


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


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
    qf, kf, vf = (x.to(torch.float32) for x in (q, k, v))
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = qf * q.shape[-1] ** -0.5
    for row in range(q.shape[0]):
        slot = int(slot_ids[row])
        if not 0 <= slot < state.shape[0]:
            continue
        s = state[slot] * g[row].exp()[:, None, None]  # [heads, dk, dv]
        kv_mem = (s * kf[row][:, :, None]).sum(dim=-2)
        delta = (vf[row] - kv_mem) * beta[row][:, None]
        s = s + kf[row][:, :, None] * delta[:, None, :]
        state[slot] = s
        out[row] = (s * qf[row][:, :, None]).sum(dim=-2).to(out.dtype)
    return out
