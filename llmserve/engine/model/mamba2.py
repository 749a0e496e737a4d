"""Mamba-2's mixer (Granite 4.0-H, Nemotron-H, Falcon-H1), reference forms on the CPU, after
transformers' GraniteMoeHybridMambaLayer / Mamba2Mixer torch path.

One request's chunk of n tokens (x [n, hidden]):

    gate, xBC, dt = in_proj(x)                       [I], [I + 2 G N], [H]   (I = H P)
    xBC = silu(depthwise causal conv over [conv state | xBC])    conv state: last K - 1 inputs
    x, B, C = xBC                                    x [n, H, P]; B, C [n, G, N]
    dt = clamp(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T;   y_t = S_t C_t + D x_t       S [H, P, N]
    out = out_proj(rmsnorm_groups(y * silu(gate)) * w)                        (G groups)

Head h reads group h // (H / G) of B and C. `recurrent` runs the recurrence token by token
(a one-token prompt); `chunked` is the state-space-duality form over chunks (a prefill chunk);
both carry S in and out, so a prefill split anywhere continues where the last chunk stopped.
A step's decode rows run together through `ops.ssd_decode` (`Mamba2Mixer.decode_rows`: on a
GPU kernels/ssd_step.cu, in place on the fp32 state pool).
`recurrent` runs kernels/ssd_step_reference.py's `ssd_update` (the CUDA decode step's
reference) per token: the recurrence is written once.

The clamp to time_step_limit is applied in both forms; transformers applies it in its chunked
form only (its decode path skips it), the same for the default (0, inf) every released
Granite 4.0-H config uses.

State per request and Mamba layer (the scheduler's state slot in the pool of
engine/kv/state.py): conv [conv_dim, K - 1] (conv_dim = I + 2 G N), ssm [H, P, N].
`Mamba2Mixer.forward` reads each row's pair from `ctx.state` (read(state_idx, row, fresh) /
write(state_idx, row, conv, ssm); zeros for a request's first chunk) and writes it back;
`Mamba2Mixer.run_chunk` is the same with the state passed explicitly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.common.mamba2_config import Mamba2Config
from llmserve.engine.model.layers import Linear, default_weight_loader
from llmserve.engine.model.ops import LayerOps, OpsModule, ReferenceOps
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels.ssd_step_reference import ssd_update


def causal_conv1d(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) of x [n, C] after state [C, K - 1] (the previous inputs,
    oldest first); weight [C, K] (or HF's [C, 1, K]). Returns (out [n, C], the new state: the
    last K - 1 inputs)."""
    weight = weight.reshape(weight.shape[0], -1)
    full = torch.cat((state.to(x.dtype), x.t()), dim=-1)  # [C, K - 1 + n]
    out = F.conv1d(full[None], weight[:, None, :], bias, groups=full.shape[0])[0]
    return F.silu(out.t()), full[:, full.shape[-1] - state.shape[-1] :].to(state.dtype)


def discretize(
    dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float] = (0.0, float("inf"))
) -> torch.Tensor:
    """The step size [n, H] (float32) from the projection's raw dt: softplus(dt + dt_bias)
    (torch's threshold 20, as the CUDA kernel's), clamped to time_step_limit."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(limit[0], limit[1])


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """B or C [n, G, N] -> [n, H, N] in float32 (group g serves heads g H/G .. (g+1) H/G)."""
    return t.float().repeat_interleave(heads // t.shape[1], dim=1)


def recurrent(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token (kernels/ssd_step_reference.py's `ssd_update`, the CUDA decode step's
    reference): x [n, H, P]; dt [n, H] (discretized); a = -exp(A_log), d [H]; b, c [n, G, N];
    state [H, P, N]. Returns (y [n, H, P] float32, the new state float32)."""
    s = state.float()
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        y[t], s = ssd_update(x[t], dt[t], a, b[t], c[t], d, s)
    return y, s


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: out[i, j] = x[j + 1] + ... + x[i] for j <= i, -inf above."""
    size = x.shape[-1]
    x = x[..., None].expand(*x.shape, size)
    below = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device), -1)
    sums = x.masked_fill(~below, 0).cumsum(-2)
    keep = torch.tril(torch.ones(size, size, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~keep, float("-inf"))


def chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    d: torch.Tensor,
    state: torch.Tensor,
    chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked (SSD) form of `recurrent`, same arguments and results: within a chunk the
    output is a masked, decayed C B^T product (attention-like); across chunks the state is
    carried by the recurrence on chunk boundaries only.

        |<- chunk 0 ->|<- chunk 1 ->| ... |<- last (zero-padded) ->|
    """
    n, heads, _ = x.shape
    chunk = min(chunk, n)  # any chunk size gives the same result; padding to it costs
    pad = (-n) % chunk
    xdt = x.float() * dt.float()[..., None]
    adt = dt.float() * a.float()  # [n, H]

    def split(t: torch.Tensor) -> torch.Tensor:  # [n, ...] -> [num_chunks, chunk, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.reshape(-1, chunk, *t.shape[1:])

    xs, bs, cs = split(xdt), split(_per_head(b, heads)), split(_per_head(c, heads))
    acs = split(adt).permute(0, 2, 1)  # [num_chunks, H, chunk]
    cum = acs.cumsum(-1)
    # within each chunk: y_l = sum_{s <= l} C_l . B_s exp(sum_{s < r <= l} a_r) x_s dt_s
    decay = torch.exp(_segsum(acs))  # [num_chunks, H, l, s]
    scores = torch.einsum("clhn,cshn->chls", cs, bs) * decay
    y = torch.einsum("chls,cshp->clhp", scores, xs)
    # each chunk's own contribution to the state at its end, then the carried states
    to_end = torch.exp(cum[..., -1:] - cum)  # [num_chunks, H, chunk]
    chunk_states = torch.einsum("clhn,chl,clhp->chpn", bs, to_end, xs)
    s = state.float().clone()
    starts = []
    for i in range(chunk_states.shape[0]):
        starts.append(s)
        s = s * torch.exp(cum[i, :, -1])[:, None, None] + chunk_states[i]
    # the carried state's part of each output: C_l . S_start exp(sum_{r <= l} a_r)
    start = torch.stack(starts)  # [num_chunks, H, P, N]
    y = y + torch.einsum("clhn,chpn,chl->clhp", cs, start, torch.exp(cum))
    y = y.reshape(-1, heads, x.shape[-1])[:n] + d.float()[:, None] * x.float()
    return y, s


def gated_rms_norm(
    y: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    groups: int,
    eps: float,
    tp: TPGroup | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """w * rmsnorm(y * silu(gate)) with the norm over each of `groups` equal slices of the
    last dimension (the gate before the norm: mamba_ssm's norm_before_gate=False); float32
    inside, y's dtype out, then times w. tp: the one group spans the ranks' heads (a
    tensor-parallel split of a one-group layer): its squares are summed across them.
    norm_before_gate (Falcon-H1's default): w * rmsnorm(y) * silu(gate), all in float32."""
    dtype = y.dtype
    h = y.float() if norm_before_gate else y.float() * F.silu(gate.float())
    h = h.view(*h.shape[:-1], groups, -1)
    if tp is not None and tp.size > 1:
        square_sum = tp.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(square_sum / (h.shape[-1] * tp.size) + eps)
    else:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if norm_before_gate:
        h = weight.float() * h.view(*y.shape) * F.silu(gate.float())
        return h.to(dtype)
    return weight * h.view(*y.shape).to(dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with its weight [I] (HF's `norm.weight`) over `groups` groups;
    tensor-parallel, this rank's heads' channels of it (`across`: the one group spans the
    ranks)."""

    def __init__(
        self,
        size: int,
        groups: int,
        eps: float,
        tp: TPGroup,
        across: bool = False,
        norm_before_gate: bool = False,
    ):
        super().__init__()
        self.groups, self.eps, self.tp, self.across = groups, eps, tp, across
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.empty(size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        n = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * n, n), shard)

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        tp = self.tp if self.across else None
        return gated_rms_norm(
            y, gate, self.weight, self.groups, self.eps, tp, self.norm_before_gate
        )


class RowParts(nn.Module):
    """A weight [rows, *tail] (and bias [rows]) stored as one HF tensor of parts side by side
    (in_proj: gate, x, B, C, dt; the conv: x, B, C): tensor-parallel, each part's rows split
    over the ranks (its 1/T: rank r's heads or groups) or, `split` False, kept whole (B and C
    of a one-group layer). forward: the linear map (in_proj)."""

    def __init__(
        self, parts: list[tuple[int, bool]], tail: tuple[int, ...], bias: bool, tp: TPGroup
    ):
        super().__init__()
        self.parts, self.tp = parts, tp
        rows = sum(n // tp.size if split else n for n, split in parts)
        self.weight = nn.Parameter(torch.empty(rows, *tail))
        self.bias = nn.Parameter(torch.empty(rows)) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        rank, size = self.tp.rank, self.tp.size
        pieces, start = [], 0
        for rows, split in self.parts:
            part = loaded[start : start + rows]
            pieces.append(part[rank * rows // size : (rank + 1) * rows // size] if split else part)
            start += rows
        default_weight_loader(param, torch.cat(pieces), shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Mamba2Mixer(OpsModule):
    """One Mamba-2 layer (the module docstring); state layer `state_idx` of the state pool.
    Parameters carry HF's names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj). Falcon-H1
    (Mamba2Config's multipliers and norm fields): the input times in_multiplier, in_proj's
    parts times proj_multipliers, no norm weight where gated_norm is off. A step's decode rows
    run their recurrence through `ops.ssd_decode` (on a GPU, kernels/ssd_step.cu when
    select_ops picks it); chunks through `run_chunk` in torch."""

    def __init__(
        self,
        hidden_size: int,
        shape: Mamba2Config,
        eps: float,
        state_idx: int,
        tp: TPGroup | None = None,
        ops: LayerOps | None = None,
    ):
        super().__init__(ops or ReferenceOps())
        self.tp = tp = tp or TPGroup()
        self.shape = s = shape.split(tp.size)  # this rank's heads (and groups)
        self.eps, self.state_idx = eps, state_idx
        whole_groups = shape.num_groups == s.num_groups  # one group, kept whole on every rank
        groups = (shape.group_size, not whole_groups or tp.size == 1)
        inner = (shape.intermediate_size, True)
        parts = [inner, inner, groups, groups, (shape.num_heads, True)]
        self.in_proj = RowParts(parts, (hidden_size,), s.proj_bias, tp)
        self.conv1d = RowParts(parts[1:4], (1, s.conv_kernel), s.conv_bias, tp)
        self.dt_bias = nn.Parameter(torch.empty(s.num_heads))
        self.A_log = nn.Parameter(torch.empty(s.num_heads))
        self.D = nn.Parameter(torch.empty(s.num_heads))
        across = tp.size > 1 and whole_groups
        self.norm: GatedRMSNorm | None = None
        if s.gated_norm:
            self.norm = GatedRMSNorm(
                s.intermediate_size, s.num_groups, eps, tp, across, s.norm_before_gate
            )
        out_bias = s.proj_bias if s.out_bias is None else s.out_bias
        self.out_proj = Linear(s.intermediate_size, [hidden_size], out_bias, tp, "input")
        self.mup: torch.Tensor | None = None  # proj_multipliers per in_proj row, made on use
        self.batch_decode = True  # decode rows together (decode_rows); False: one by one

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """dt_bias, A_log and D (its own parameters): this rank's heads'."""
        n = self.shape.num_heads
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * n, n), shard)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate [n, I], xBC [n, conv_dim], raw dt [n, H]) from in_proj, with Falcon-H1's
        multipliers where the config has them."""
        s = self.shape
        if s.in_multiplier != 1.0:
            hidden = hidden * s.in_multiplier
        projected = self.in_proj(hidden)
        if any(m != 1.0 for m in s.proj_multipliers):
            if self.mup is None or self.mup.device != projected.device:
                i, g = s.intermediate_size, s.group_size
                sizes = (i, i, g, g, s.num_heads)
                multipliers = zip(sizes, s.proj_multipliers, strict=True)
                parts = [torch.full((n,), m) for n, m in multipliers]
                self.mup = torch.cat(parts).to(projected.device)
            projected = projected * self.mup.to(projected.dtype)
        gate, xbc, dt = projected.split([s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        return gate, xbc, dt

    def new_state(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh request's (conv [conv_dim, K - 1], ssm [H, P, N]) state: zeros."""
        s = self.shape
        return like.new_zeros(s.conv_shape), like.new_zeros(s.ssm_shape)

    def run_chunk(
        self, xbc: torch.Tensor, dt: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's chunk from its projected xBC [n, conv_dim] and raw dt [n, H], from
        state (conv, ssm). Returns (y [n, I] float32 before the gated norm, conv, ssm)."""
        s, n = self.shape, xbc.shape[0]
        mixed, conv = causal_conv1d(xbc, conv, self.conv1d.weight, self.conv1d.bias)
        x, b, c = mixed.split([s.intermediate_size, s.group_size, s.group_size], dim=-1)
        x = x.reshape(n, s.num_heads, s.head_dim)
        b, c = b.reshape(n, s.num_groups, s.state_size), c.reshape(n, s.num_groups, s.state_size)
        step = discretize(dt, self.dt_bias, s.time_step_limit)
        a = -torch.exp(self.A_log.float())
        if n == 1:
            y, new = recurrent(x, step, a, b, c, self.D, ssm)
        else:
            y, new = chunked(x, step, a, b, c, self.D, ssm, s.chunk_size)
        return y.reshape(n, s.intermediate_size), conv, new.to(ssm.dtype)

    def decode_rows(
        self,
        rows: list[int],
        tokens: list[int],
        xbc: torch.Tensor,
        dt: torch.Tensor,
        y: torch.Tensor,
        states: Any,
    ) -> None:
        """Decode rows `rows` (one token each, at `tokens` of the flattened batch) as one
        batch: their conv states gathered, the conv's one output per row as a product with the
        taps, then `ops.ssd_decode` on their slots of the layer's SSM pool (in place), the conv
        states scattered back; y's rows filled."""
        s, n = self.shape, len(rows)
        conv = states.gather_conv(self.state_idx, rows)  # [R, C, K - 1]
        index = torch.tensor(tokens, device=xbc.device)
        full = torch.cat((conv.to(xbc.dtype), xbc[index][..., None]), dim=-1)  # [R, C, K]
        weight = self.conv1d.weight.reshape(s.conv_dim, -1)
        mixed = (full * weight).sum(-1)
        if self.conv1d.bias is not None:
            mixed = mixed + self.conv1d.bias
        x, b, c = F.silu(mixed).split([s.intermediate_size, s.group_size, s.group_size], dim=-1)
        b, c = b.reshape(n, s.num_groups, s.state_size), c.reshape(n, s.num_groups, s.state_size)
        a = -torch.exp(self.A_log.float())
        pool = states.recurrent(self.state_idx)  # [slots, H, P, N] float32
        out = self.ops.ssd_decode(
            x.reshape(n, s.num_heads, s.head_dim), dt[index], self.dt_bias, a, b, c, self.D,
            pool, states.slot_ids(rows, pool.device), s.time_step_limit,
        )  # fmt: skip
        y[index] = out.reshape(n, s.intermediate_size).to(y.dtype)
        states.scatter_conv(self.state_idx, rows, full[..., 1:])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: object) -> torch.Tensor:
        """The flattened batch's rows (ctx.cu_seqlens_q), each from and back into its state
        slot (ctx.state; without one, as in the memory profile, from zeros, kept nowhere)."""
        s = self.shape
        gate, xbc, dt = self.project(hidden)
        cu: list[int] = ctx.cu_seqlens_q  # type: ignore[attr-defined]
        seq_lens: list[int] = ctx.seq_lens  # type: ignore[attr-defined]
        states = getattr(ctx, "state", None)
        if states is not None and states.pool is None:
            states = None
        y = torch.empty(hidden.shape[0], s.intermediate_size, device=hidden.device)
        # a step's decode rows (one token, running on) together (ops.ssd_decode: on a GPU one
        # kernel launch); the other rows one by one
        batched = [] if states is None else [
            r for r in range(len(cu) - 1) if cu[r + 1] - cu[r] == 1 and seq_lens[r] > 1
        ]  # fmt: skip
        if batched and self.batch_decode:
            self.decode_rows(batched, [cu[r] for r in batched], xbc, dt, y, states)
        else:
            batched = []
        for row in range(len(cu) - 1):
            if row in batched:
                continue
            rows = slice(cu[row], cu[row + 1])
            fresh = seq_lens[row] == cu[row + 1] - cu[row]  # its first chunk
            if states is None:
                conv, ssm = self.new_state(hidden)
            else:
                conv, ssm = states.read(self.state_idx, row, fresh)
            y[rows], conv, ssm = self.run_chunk(xbc[rows], dt[rows], conv, ssm)
            if states is not None:
                states.write(self.state_idx, row, conv, ssm)
        out = y * F.silu(gate.float()) if self.norm is None else self.norm(y, gate)
        return self.tp.all_reduce(self.out_proj(out.to(hidden.dtype)))
