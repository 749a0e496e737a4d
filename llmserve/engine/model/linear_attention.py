"""Gated delta rule (Qwen3-Next's gated DeltaNet layers), reference forms on the CPU.

One sequence at a time, serving layout: q, k [T, H, Dk]; v [T, H, Dv]; g (log decay) and
beta [T, H]; state [H, Dk, Dv]. q and k are expected l2-normalised already; q is scaled by
Dk ** -0.5 here. Two forms that must agree: `recurrent` (token by token, the decode step)
and `chunked` (the WY form over chunks, the prefill), both carrying the state in and out,
so a chunked prefill split anywhere continues exactly where the last chunk stopped. The
one-token update is kernels/gated_delta_reference.delta_step, the CUDA kernel's reference:
this module uses it rather than keeping a second copy.
"""

from __future__ import annotations

import torch

from llmserve.kernels.gated_delta_reference import delta_step


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule; returns (out [T, H, Dv], new state)."""
    q = q.float() * q.shape[-1] ** -0.5
    s = state.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        out[t], s = delta_step(q[t], k[t].float(), v[t], g[t], beta[t], s)
    return out, s


def _chunk_inputs(x: torch.Tensor, size: int, pad: int) -> torch.Tensor:
    """[T, H, ...] -> [H, N, C, ...] in float32, zero-padded at the end."""
    x = x.float().transpose(0, 1)
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    return x.reshape(x.shape[0], -1, size, *x.shape[2:])


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (WY) form of `recurrent`; same arguments and results."""
    t_len = q.shape[0]
    pad = (-t_len) % chunk
    qc, kc, vc = (_chunk_inputs(x, chunk, pad) for x in (q, k, v))
    gc, bc = (_chunk_inputs(x, chunk, pad) for x in (g, beta))
    qc = qc * q.shape[-1] ** -0.5
    gc = gc.cumsum(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).tril().exp().tril()
    k_beta, v_beta = kc * bc[..., None], vc * bc[..., None]
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=q.device))
    attn = -((k_beta @ kc.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, chunk):
        row = attn[..., i, :i].clone()
        attn[..., i, :i] = row + (row[..., None] * attn[..., :i, :i]).sum(-2)
    attn = attn + torch.eye(chunk, device=q.device)
    value = attn @ v_beta
    k_cum = attn @ (k_beta * gc.exp()[..., None])
    strict = torch.triu(upper, diagonal=1)
    s = state.float().clone()
    out = torch.zeros_like(vc)
    for n in range(qc.shape[1]):
        qi, ki, gi = qc[:, n], kc[:, n], gc[:, n]
        inner = (qi @ ki.transpose(-1, -2) * decay[:, n]).masked_fill(strict, 0)
        v_new = value[:, n] - k_cum[:, n] @ s
        out[:, n] = (qi * gi.exp()[..., None]) @ s + inner @ v_new
        last = gi[:, -1]
        s = (
            s * last.exp()[:, None, None]
            + (ki * (last[:, None] - gi).exp()[..., None]).transpose(-1, -2) @ v_new
        )
    out = out.reshape(out.shape[0], -1, out.shape[-1])[:, :t_len]
    return out.transpose(0, 1), s


def decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences at once (a step's decode rows): q, k [B, H, Dk];
    v [B, H, Dv]; g, beta [B, H]; state [B, H, Dk, Dv]. `recurrent` of one token per row;
    returns (out [B, H, Dv], new states)."""
    q = q.float() * q.shape[-1] ** -0.5
    return delta_step(q, k.float(), v, g, beta, state.float())
