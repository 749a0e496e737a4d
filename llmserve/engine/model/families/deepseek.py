"""DeepSeek-V3 / Kimi K2: multi-head latent attention (MLA) over a latent KV pool, and
DeepSeek-V3's MoE (engine/model/families/moe.SparseLayers, the router GLM-4.5 shares).

MLA with the up-projection absorbed: per head, W_UK (kv_b_proj's k rows) is folded into the
query and W_UV applied after, so

    score(t) = [W_UK^T q_nope | q_rot] . [c_t | k_rot_t]      out = W_UV (sum_t p_t c_t)

is multi-query attention over one latent "head" [c_t | k_rot_t]: the layer hands the ops the
latent as both key and value and keeps the first kv_lora_rank of each output row. Prefill takes
the same absorbed form. See docs/models.md#multi-head-latent-attention-deepseek-v3-kimi-k2.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.families.moe import SparseLayers
from llmserve.engine.model.layers import Linear, RMSNorm, RotaryEmbedding, default_weight_loader
from llmserve.engine.model.ops import AttentionContext, LayerOps, OpsModule
from llmserve.engine.parallel.groups import TPGroup

# transformers' DeepseekV3RMSNorm default, which the q and kv latents' norms keep (their eps is
# not config.rms_norm_eps)
LATENT_NORM_EPS = 1e-6


def deinterleave_rows(rope_dim: int, head_dim: int, num_heads: int) -> torch.Tensor:
    """Row order that turns each head's last rope_dim rows from DeepSeek's interleaved pairs
    (x0, x1), (x2, x3)... into rotate-half's halves (x0, x2, ..., x1, x3, ...): the rotated
    values then equal transformers' apply_rotary_pos_emb_interleave exactly."""
    order = torch.arange(num_heads * head_dim).view(num_heads, head_dim)
    rope = order[:, head_dim - rope_dim :]
    order[:, head_dim - rope_dim :] = torch.cat((rope[:, 0::2], rope[:, 1::2]), dim=1)
    return order.flatten()


class RopeRowsLinear(Linear):
    """A Linear whose checkpoint rows are permuted at load (`rows`: the new row order of the
    whole tensor), before a column-parallel rank takes its rows (output_size: this rank's)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        rows: torch.Tensor | None,
        tp: TPGroup | None = None,
    ):
        super().__init__(input_size, [output_size], bias, tp, "output")
        self.rows = rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.rows is not None:
            loaded = loaded[self.rows]
        super().weight_loader(param, loaded, shard)


class LatentProjection(nn.Module):
    """kv_b_proj's weight [heads * (nope + v), kv_lora_rank] of this rank's heads (not a Linear:
    the layer reads it per head, and no pass may swap it for a packed or quantized linear)."""

    def __init__(self, num_heads: int, nope: int, v: int, rank: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank))
        self.split = (num_heads, nope, v)
        self.tp = tp

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        rows = param.shape[0]  # rank r's heads are rows r * rows .. (r + 1) * rows
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * rows, rows), shard)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, nope, rank], W_UV [heads, v, rank]), views of the weight."""
        heads, nope, v = self.split
        per_head = self.weight.view(heads, nope + v, -1)
        return per_head[:, :nope], per_head[:, nope:]


class GGUFLatentHalves(Mapping[str, torch.Tensor]):
    """A deepseek2 GGUF's tensors under HF's names where llama.cpp's converter renamed or split
    them (common/families/deepseek.py DEEPSEEK2_GGUF_NAMES): kv_b_proj [heads * (nope + v),
    rank] joined per head from k_b_proj [heads, rank, nope] (transposed back) and v_b_proj
    [heads, v, rank]; the router's correction bias from `e_score_correction.bias`. An HF
    checkpoint passes through unchanged."""

    HALVES = re.compile(r"(.*\.self_attn\.)kv_b_proj\.weight")
    BIAS = "gate.e_score_correction_bias"

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights
        renamed = (
            n.replace("k_b_proj.", "kv_b_proj.") if n.endswith(".k_b_proj.weight")
            else n.replace("e_score_correction.bias", "e_score_correction_bias")
            for n in weights
            if n.endswith((".k_b_proj.weight", "e_score_correction.bias"))
        )  # fmt: skip
        self.names = [*weights, *renamed]

    def source(self, name: str) -> str | tuple[str, str] | None:
        """The GGUF name(s) an HF name is read from (None: as it is)."""
        if name in self.weights:
            return None
        m = self.HALVES.fullmatch(name)
        if m and m[1] + "k_b_proj.weight" in self.weights:
            return m[1] + "k_b_proj.weight", m[1] + "v_b_proj.weight"
        if name.endswith(self.BIAS):
            return name.removesuffix(self.BIAS) + "gate.e_score_correction.bias"
        return None

    def __getitem__(self, name: str) -> torch.Tensor:
        where = self.source(name)
        if where is None:
            return self.weights[name]
        if isinstance(where, str):
            return self.weights[where]
        k_b, v_b = self.weights[where[0]], self.weights[where[1]]
        return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        where = self.source(name)
        if where is None:
            return name in self.weights
        return all(n in self.weights for n in ((where,) if isinstance(where, str) else where))

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class MLAttention(OpsModule):
    """DeepSeek-V3's attention of pool layer `layer_idx`: q through q_a / q_a_layernorm / q_b
    (or q_proj without q_lora_rank), the latent through kv_a_proj_with_mqa and kv_a_layernorm,
    its rotary part rotated, stored in the pool's latent layout and attended to absorbed."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup,
    ):
        """tp: the heads split T ways (q's and kv_b's rows, o_proj's columns); the latent, its
        projection and norm are every rank's whole."""
        super().__init__(ops)
        mla = config.mla
        assert mla is not None
        self.mla, self.layer_idx, self.rotary_emb, self.tp = mla, layer_idx, rotary, tp
        self.num_heads = heads = config.num_heads // tp.size
        self.scale = config.attention_scale or mla.qk_head_dim**-0.5
        hidden, bias, rope = config.hidden_size, config.attention_bias, mla.qk_rope_head_dim
        q_rows = None
        if mla.rope_interleave:
            q_rows = deinterleave_rows(rope, mla.qk_head_dim, config.num_heads)
        kv_rows = deinterleave_rows(rope, mla.latent_dim, 1) if mla.rope_interleave else None
        q_out = heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = RopeRowsLinear(hidden, q_out, False, q_rows, tp)
        else:
            self.q_a_proj = Linear(hidden, [mla.q_lora_rank], bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, ops)
            self.q_b_proj = RopeRowsLinear(mla.q_lora_rank, q_out, False, q_rows, tp)
        self.kv_a_proj_with_mqa = RopeRowsLinear(hidden, mla.latent_dim, bias, kv_rows)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = LatentProjection(
            heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank, tp
        )
        self.o_proj = Linear(heads * mla.v_head_dim, [hidden], bias, tp, "input")

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[tokens, heads, nope + rope]: each head's query, its rope part not yet rotated."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))[0])
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        rank, nope = mla.kv_lora_rank, mla.qk_nope_head_dim
        q_nope, q_rot = self.queries(hidden).split([nope, mla.qk_rope_head_dim], dim=-1)
        c, k_rot = self.kv_a_proj_with_mqa(hidden).split([rank, mla.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c.contiguous())[0]
        q_rot, k_rot = self.rotary_emb(
            positions, q_rot.contiguous(), k_rot.reshape(num_tokens, 1, -1).contiguous()
        )
        w_uk, w_uv = self.kv_b_proj.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        query = torch.cat((q_latent, q_rot), dim=-1)
        latent = torch.cat((c.view(num_tokens, 1, rank), k_rot), dim=-1)
        cache = ctx.kv_caches[self.layer_idx][0]
        attn = self.ops.latent_attention(query, latent, cache, ctx, self.scale, rank)
        out = torch.bmm(attn.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.tp.all_reduce(self.o_proj(out.transpose(0, 1).reshape(num_tokens, -1)))


class DeepseekV3ForCausalLM(SparseLayers):
    """MLA in every layer; MoE after the first first_k_dense_replace layers."""

    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return super().checkpoint_view(GGUFLatentHalves(weights))

    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return MLAttention(config, local, self.rotary_for(layer), ops, tp)
