"""Qwen3-Next: gated DeltaNet layers (`linear_attention`) and gated full attention
(`full_attention`), a mixture of experts with a gated shared expert, zero-centred RMSNorms.
Written after transformers' modeling_qwen3_next.py.

A DeltaNet layer, for one request's chunk of n tokens (x [n, hidden]):

    q, k, v, z = in_proj_qkvz(x)   per key head: [q (dk), k (dk), v (g dv), z (g dv)], g = Hv / Hk
    b, a       = in_proj_ba(x)     per key head: [b (g), a (g)]
    q, k, v    = silu(depthwise causal conv over [conv state | q k v])   state: last K - 1 inputs
    beta = sigmoid(b);  decay g_t = -exp(A_log) softplus(a + dt_bias)
    o, S = gated delta rule(l2norm(q), l2norm(k), v, g, beta, S)  (engine/model/linear_attention.py:
           `chunked` for a prefill chunk, `recurrent` for a decode row; S [Hv, dk, dv])
    out  = out_proj(rmsnorm(o) * w * silu(z))

Each request's conv state and S live in its state slot (engine/kv/state.py): read at the start
of the chunk (zeros for a request's first chunk), written back at its end, so a chunked prefill
continues where the last chunk stopped. The full-attention layers keep KV in the paged pool as
every family's do (only they have a slice of it: ModelConfig.kv_layer_index).

Qwen3.5 (`Qwen3_5ForCausalLM`, common/families/qwen3_5.py) is this model with the DeltaNet's
projections stored flat (`FlatGatedDeltaNet`) and its checkpoint possibly under
`model.language_model.` (the multimodal class's).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import ClassVar

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.common.state_layout import GatedDeltaNetConfig
from llmserve.engine.model import linear_attention
from llmserve.engine.model.families.moe import SparseLayers
from llmserve.engine.model.families.phi3 import SplitFused
from llmserve.engine.model.layers import (
    MLP,
    DecoderLayer,
    Linear,
    NormClass,
    RotaryEmbedding,
    UnitOffsetRMSNorm,
    default_weight_loader,
)
from llmserve.engine.model.moe import HFTensor
from llmserve.engine.model.ops import AttentionContext, LayerOps, OpsModule
from llmserve.engine.parallel.groups import TPGroup


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dimension, as transformers' (and FLA's) l2norm."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(z), in float32, per value head (w not offset by 1)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = self.weight * x.to(dtype)
        return (x * nn.functional.silu(z.float())).to(dtype)


class DepthwiseConv(nn.Module):
    """The causal depthwise conv's taps, [channels, 1, K] (transformers' nn.Conv1d weight).
    Tensor-parallel, this rank's channels of each part (q, k, v), whose whole sizes are
    `parts`."""

    def __init__(self, parts: tuple[int, ...], kernel: int, tp: TPGroup):
        super().__init__()
        self.parts, self.tp = parts, tp
        self.weight = nn.Parameter(torch.empty(sum(parts) // tp.size, 1, kernel))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        rank, size = self.tp.rank, self.tp.size
        pieces, start = [], 0
        for part in self.parts:
            pieces.append(loaded[start + rank * part // size : start + (rank + 1) * part // size])
            start += part
        default_weight_loader(param, torch.cat(pieces), shard)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """silu(conv) of x [n, C] after state [C, K - 1] (the previous inputs); returns (out
        [n, C], the new state: the last K - 1 inputs)."""
        full = torch.cat((state, x.t().to(state.dtype)), dim=-1)  # [C, K - 1 + n]
        out = nn.functional.conv1d(full[None].to(x.dtype), self.weight, groups=full.shape[0])
        return nn.functional.silu(out[0].t()), full[:, -state.shape[-1] :]


class GatedDeltaNet(OpsModule):
    """A gated DeltaNet layer (see the module); state layer `state_idx` of the state pool.
    Tensor-parallel, each rank holds whole key heads and their value heads (the projections'
    per-key-head groups split by rows, out_proj by columns, summed in an all-reduce). Decode
    rows go through ops.gated_delta_decode (on a GPU, kernels/gated_delta.cu when select_ops
    chose it), prefill chunks through linear_attention's torch forms."""

    def __init__(self, config: ModelConfig, state_idx: int, ops: LayerOps, tp: TPGroup):
        super().__init__(ops)
        whole = config.gated_delta_net
        assert whole is not None, "qwen3_next: config.json gave no linear_* fields"
        shape = whole.split(tp.size)
        self.shape: GatedDeltaNetConfig = shape
        self.state_idx, self.tp = state_idx, tp
        hidden, nv = config.hidden_size, shape.num_v_heads
        qkvz = [2 * shape.key_dim + 2 * shape.value_dim]
        self.in_proj_qkvz = Linear(hidden, qkvz, False, tp, "output")
        self.in_proj_ba = Linear(hidden, [2 * nv], False, tp, "output")
        parts = (whole.key_dim, whole.key_dim, whole.value_dim)
        self.conv1d = DepthwiseConv(parts, shape.conv_kernel, tp)
        self.dt_bias = nn.Parameter(torch.empty(nv))
        self.A_log = nn.Parameter(torch.empty(nv))
        self.norm = GatedRMSNorm(shape.head_v_dim, config.rms_norm_eps)
        self.out_proj = Linear(shape.value_dim, [hidden], False, tp, "input")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """dt_bias and A_log (its own parameters): this rank's value heads'."""
        n = self.shape.num_v_heads
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * n, n), shard)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(qkv [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv]) of x [T, hidden], out of
        the projections' per-key-head groups."""
        s, t = self.shape, x.shape[0]
        group = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(t, s.num_k_heads, -1)
        sizes = [s.head_k_dim, s.head_k_dim, group * s.head_v_dim, group * s.head_v_dim]
        q, k, v, z = qkvz.split(sizes, dim=-1)
        b, a = self.in_proj_ba(x).view(t, s.num_k_heads, 2 * group).split([group, group], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        nv = s.num_v_heads
        return qkv, z.reshape(t, nv, s.head_v_dim), b.reshape(t, nv), a.reshape(t, nv)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        qkv, z, b, a = self.split(hidden)
        beta = b.sigmoid()
        decay = -self.A_log.float().exp() * nn.functional.softplus(a.float() + self.dt_bias)
        out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
        cu = ctx.cu_seqlens_q
        pooled = ctx.state is not None and ctx.state.pool is not None
        decodes: list[int] = []  # rows of one token continuing a state: run together
        for row in range(len(cu) - 1):
            n = cu[row + 1] - cu[row]
            fresh = ctx.seq_lens[row] == n  # its first chunk
            if n == 1 and not fresh and pooled:
                decodes.append(row)
                continue
            rows = slice(cu[row], cu[row + 1])
            out[rows] = self.run_chunk(ctx, row, fresh, qkv[rows], decay[rows], beta[rows])
        if decodes:
            at = torch.tensor([cu[r] for r in decodes], device=qkv.device)
            out[at] = self.run_decodes(ctx, decodes, qkv[at], decay[at], beta[at])
        s = self.shape
        core = self.norm(
            out.to(hidden.dtype).reshape(-1, s.head_v_dim), z.reshape(-1, s.head_v_dim)
        )
        return self.tp.all_reduce(self.out_proj(core.reshape(hidden.shape[0], s.value_dim)))

    def run_chunk(
        self,
        ctx: AttentionContext,
        row: int,
        fresh: bool,
        qkv: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """One request's chunk from its slot's state (zeros when fresh), the state written back;
        returns the delta rule's output [n, Hv, dv] (float32)."""
        s, n = self.shape, qkv.shape[0]
        conv_state, state = self.read_state(ctx, row, fresh, qkv)
        mixed, conv_state = self.conv1d(qkv, conv_state)
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q, k = (
            l2norm(x.reshape(n, s.num_k_heads, s.head_k_dim).float()).repeat_interleave(group, 1)
            for x in (q, k)
        )
        v = v.reshape(n, s.num_v_heads, s.head_v_dim)
        rule = linear_attention.recurrent if n == 1 else linear_attention.chunked
        out, state = rule(q, k, v, decay, beta, state)
        if ctx.state is not None:
            ctx.state.write(self.state_idx, row, conv_state, state)
        return out

    def run_decodes(
        self,
        ctx: AttentionContext,
        rows: list[int],
        qkv: torch.Tensor,
        decay: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """B decode rows' tokens (qkv [B, C]) at once: the conv as a dot product over each
        row's K - 1 previous inputs and this one (torch), then ops.gated_delta_decode on their
        slots of the layer's recurrent pool, in place; the conv states gathered from and
        scattered back into their slots. Returns [B, Hv, dv] (float32)."""
        assert ctx.state is not None
        s, num = self.shape, len(rows)
        conv_state = ctx.state.gather_conv(self.state_idx, rows)  # [B, C, K - 1]
        full = torch.cat((conv_state, qkv[:, :, None].to(conv_state.dtype)), dim=-1)
        mixed = nn.functional.silu((full.to(qkv.dtype) * self.conv1d.weight[:, 0]).sum(-1))
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_v_heads // s.num_k_heads
        q, k = (
            x.reshape(num, s.num_k_heads, s.head_k_dim).repeat_interleave(group, 1) for x in (q, k)
        )
        v = v.reshape(num, s.num_v_heads, s.head_v_dim)
        pool = ctx.state.recurrent(self.state_idx)
        slot_ids = ctx.state.slot_ids(rows, pool.device)
        out = self.ops.gated_delta_decode(q, k, v, decay, beta, pool, slot_ids)
        ctx.state.scatter_conv(self.state_idx, rows, full[:, :, 1:])
        return out.float()  # the kernel's is in the model's dtype

    def read_state(
        self, ctx: AttentionContext, row: int, fresh: bool, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [C, K - 1], recurrent state [Hv, dk, dv]) the row's chunk starts from:
        its slot's, or zeros (a fresh request, or a step with no pool: the memory profile)."""
        if ctx.state is not None and ctx.state.pool is not None:
            return ctx.state.read(self.state_idx, row, fresh)
        s = self.shape
        conv = like.new_zeros(s.conv_dim, s.conv_kernel - 1)
        return conv, like.new_zeros(s.num_v_heads, s.head_k_dim, s.head_v_dim)


class FlatGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's DeltaNet: the projections stored flat, in_proj_qkvz filled from HF's
    `in_proj_qkv` (its q, k, v parts) and `in_proj_z`, in_proj_ba from `in_proj_b` and
    `in_proj_a`. Tensor-parallel, each part splits by rows: a rank's key heads' q and k, its
    value heads' v, z, b and a (value head j serves key head j // (Hv / Hk), so they stay
    together)."""

    def __init__(self, config: ModelConfig, state_idx: int, ops: LayerOps, tp: TPGroup):
        super().__init__(config, state_idx, ops, tp)
        s, hidden = self.shape, config.hidden_size
        sizes = [s.key_dim, s.key_dim, s.value_dim, s.value_dim]
        self.in_proj_qkvz = Linear(hidden, sizes, False, tp, "output")
        self.in_proj_ba = Linear(hidden, [s.num_v_heads] * 2, False, tp, "output")

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s, t = self.shape, x.shape[0]
        qkv, z = self.in_proj_qkvz(x).split([s.conv_dim, s.value_dim], dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        return qkv, z.reshape(t, s.num_v_heads, s.head_v_dim), b, a


class GatedAttention(OpsModule):
    """Full attention with an output gate: q_proj gives each head [q (d), gate (d)]; q and k
    RMSNorm'd per head (1 + w), partial rotary; the output times sigmoid(gate), then o_proj.
    kv_idx: the layer's slice of the KV pool. Tensor-parallel, the heads split as Attention's."""

    def __init__(
        self,
        config: ModelConfig,
        kv_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup,
    ):
        super().__init__(ops)
        self.layer_idx, self.tp = kv_idx, tp
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = d = config.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        sizes = [2 * self.q_size, self.kv_size, self.kv_size]
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, sizes, bias, tp, "output")
        self.o_proj = Linear(self.q_size, [config.hidden_size], bias, tp, "input")
        self.q_norm = UnitOffsetRMSNorm(d, config.rms_norm_eps, ops)
        self.k_norm = UnitOffsetRMSNorm(d, config.rms_norm_eps, ops)
        self.rotary_emb = rotary
        self.scale = d**-0.5

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        qg, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], -1)
        q, gate = qg.reshape(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        q = self.q_norm(q.reshape(-1, d))[0].view(t, self.num_heads, d)
        k = self.k_norm(k.reshape(-1, d))[0].view(t, self.num_kv_heads, d)
        q, k = self.rotary_emb(positions, q, k)
        v = v.reshape(t, self.num_kv_heads, d)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        attn = self.ops.attention(q, k, v, k_cache, v_cache, ctx, self.scale)
        attn = attn.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.tp.all_reduce(self.o_proj(attn))


class Qwen3NextForCausalLM(SparseLayers):
    """Tensor-parallel over heads (DeltaNet key heads, attention heads) and experts;
    pipeline-parallel by layers (each stage's KV and state pools hold its own)."""

    norm_class: NormClass = UnitOffsetRMSNorm
    delta_net: type[GatedDeltaNet] = GatedDeltaNet

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        rotary = self.rotary_for(layer)
        start = self.shard.layers.start  # this stage's pools hold its own layers, from 0
        mixer: nn.Module
        if config.layer_types[layer] == "linear_attention":
            state_idx = config.state_layer_index(layer) - config.state_layer_index(start)
            mixer = self.delta_net(config, state_idx, ops, tp)
        else:
            kv_idx = config.kv_layer_index(layer) - config.kv_layer_index(start)
            mixer = GatedAttention(config, kv_idx, rotary, ops, tp)
        return DecoderLayer(
            config, local, rotary, ops, tp,
            attention=mixer, mlp=self.make_mlp(config, layer, ops, tp), norm=self.norm_class,
        )  # fmt: skip

    def make_mlp(self, config: ModelConfig, layer: int, ops: LayerOps, tp: TPGroup) -> nn.Module:
        """SparseLayers' (a sparse block or the dense MLP), or the dense MLP everywhere for a
        config without experts (num_experts 0)."""
        if config.moe is None:
            return MLP(config, ops, tp)
        return super().make_mlp(config, layer, ops, tp)

    def hf_tensors(self) -> Iterator[HFTensor]:
        """SparseLayers' names, a DeltaNet layer's under `linear_attn.` (HF's) rather than the
        layer's `self_attn.` attribute."""
        layer_types = self.config.layer_types
        for name, *rest in super().hf_tensors():
            m = re.match(r"model\.layers\.(\d+)\.self_attn\.", name)
            if m and layer_types[int(m[1])] == "linear_attention":
                name = name.replace(".self_attn.", ".linear_attn.", 1)
            yield (name, *rest)  # type: ignore[misc]


class LanguageModelPrefix(Mapping[str, torch.Tensor]):
    """A multimodal checkpoint's text-model tensors (`model.language_model.X`) seen as
    `model.X`; the rest (lm_head, the vision tower's, mtp's) as they are."""

    PREFIX = "model.language_model."

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights
        self.names = {
            "model." + k.removeprefix(self.PREFIX) if k.startswith(self.PREFIX) else k: k
            for k in weights
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.weights[self.names[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 and Qwen3.5-MoE (dense MLPs, or a sparse block in every layer: config.moe),
    from a text-model checkpoint or the multimodal class's; tensor- and pipeline-parallel as
    Qwen3-Next."""

    delta_net = FlatGatedDeltaNet
    PARTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "in_proj_qkvz": ("in_proj_q", "in_proj_k", "in_proj_v", "in_proj_z"),
        "in_proj_ba": ("in_proj_b", "in_proj_a"),
    }

    def hf_tensors(self) -> Iterator[HFTensor]:
        """Qwen3-Next's names, a DeltaNet's two projections read from HF's flat parts."""
        for name, module, param, shard in super().hf_tensors():
            stem, _, kind = name.rpartition(".")
            prefix, _, leaf = stem.rpartition(".")
            if leaf in self.PARTS and prefix.endswith(".linear_attn"):
                for i, part in enumerate(self.PARTS[leaf]):
                    yield f"{prefix}.{part}.{kind}", module, param, i
            else:
                yield name, module, param, shard

    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """`model.language_model.` read as `model.`; `in_proj_qkv` as its q, k, v parts."""
        net = self.config.gated_delta_net
        assert net is not None
        parts = {"in_proj_qkv": [("in_proj_q", net.key_dim), ("in_proj_k", net.key_dim)]}
        parts["in_proj_qkv"].append(("in_proj_v", net.value_dim))
        split = SplitFused(LanguageModelPrefix(weights), parts)
        return super().checkpoint_view(split)
