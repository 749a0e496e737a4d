"""The mixture-of-experts ops in plain torch: the ground truth for kernels/moe.cu and what the
CPU engine runs (kernels/reference.py holds the other layer ops).

    x [T, H], weights [T, k] (float32), ids [T, k] (int64): token t uses experts ids[t, :]
    w13 [E_local, 2 I, H]: each expert's gate rows, then its up rows; w2 [E_local, H, I]
    the local experts are first_expert .. first_expert + E_local - 1 (expert parallelism: a
    rank's share); pairs (t, j) whose expert is elsewhere contribute nothing here

    out[t] = sum over j of weights[t, j] * w2[e] @ (silu(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))
             with e = ids[t, j] - first_expert, in x's dtype

gpt-oss's experts (`ClampedSwiGLU`) add biases to both products and take the clamped SwiGLU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.kernels.reference import silu_and_mul


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]): softmax over the experts in float32,
    the k largest (torch.topk's order and ties, as HF's routers), divided by their sum if
    renormalize (Mixtral always; Qwen's norm_topk_prob)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(
    ids: torch.Tensor, first_expert: int, num_local: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The (token, j) pairs whose expert is local, sorted by expert: (their flat indices into
    ids [T * k], their tokens, the rows of each local expert). A stable sort: pairs of one expert
    stay in token order.

        sorted pairs:  |<- expert 0: counts[0] ->|<- expert 1: counts[1] ->| ...
    """
    flat = ids.flatten() - first_expert
    mine = (flat >= 0) & (flat < num_local)
    keys = torch.where(mine, flat, num_local)  # other ranks' experts sort last, then are cut
    counts = torch.bincount(keys, minlength=num_local + 1)[:num_local]
    num_pairs = int(counts.sum())
    pairs = torch.argsort(keys, stable=True)[:num_pairs]
    return pairs, torch.div(pairs, ids.shape[1], rounding_mode="floor"), counts.tolist()


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """x's rows sorted by group (counts[e] rows for group e, in order) times weight[e]^T:
    [n, in] x [E, out, in] -> [n, out]. One product per non-empty segment. (F.linear, not
    torch.mm into a slice of one output: on the CPU the latter ran 5x slower for 1-row
    segments, bench/studies/moe_cpu.py's decode case.)"""
    parts = []
    start = 0
    for e, count in enumerate(counts):
        if count:
            parts.append(F.linear(x[start : start + count], weight[e]))
            start += count
    return torch.cat(parts) if len(parts) != 1 else parts[0]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's experts: biases b13 [E_local, 2 I] (gate, then up) and b2 [E_local, H] in the
    weights' dtype, and in place of SiLU-and-mul, with g = min(gate, limit) and
    u = clamp(up, -limit, limit): (u + 1) * g * sigmoid(alpha * g)."""

    b13: torch.Tensor
    b2: torch.Tensor
    alpha: float
    limit: float

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    first_expert: int = 0,
    oss: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """The routed experts' sum for every token ([T, H], x's dtype; see the module docstring):
    the pairs sorted by expert, each token's row gathered once per pair, each expert's segment
    one product per weight, the rows scaled and added back into their tokens in expert order.
    oss: gpt-oss's biases and activation."""
    pairs, tokens, counts = sort_by_expert(ids, first_expert, w13.shape[0])
    out = torch.zeros_like(x)
    if not pairs.numel():
        return out
    rows = x.index_select(0, tokens)
    gate_up = grouped_linear(rows, w13, counts)
    if oss is None:
        hidden = silu_and_mul(gate_up)
        rows = grouped_linear(hidden, w2, counts)
    else:
        local = ids.flatten().index_select(0, pairs) - first_expert
        hidden = oss.activation(gate_up + oss.b13.index_select(0, local))
        rows = grouped_linear(hidden, w2, counts) + oss.b2.index_select(0, local)
    rows = rows * weights.flatten().index_select(0, pairs).unsqueeze(1).to(rows.dtype)
    return out.index_add_(0, tokens, rows)
