"""Falcon-H1 (FalconH1ForCausalLM), after transformers' modeling_falcon_h1.py: in every layer
attention and a Mamba-2 mixer (engine/model/mamba2.py) side by side on the same normed input,

    h = h + mamba(norm(h)) * ssm_out + attn(norm(h) * attention_in) * attention_out
    h = h + down(up(x) * silu(gate(x) * mlp_gate)) * mlp_down,   x = pre_ff_norm(h)

then final_layernorm and logits * lm_head_multiplier; embeddings x embedding_multiplier; the
keys x key_multiplier (as the softmax scale: common/families/falcon_h1.py); the mixer's own
multipliers and optional gated norm are its Mamba2Config's. Layer i is KV-pool layer i and
state layer i (its conv + SSM state in the request's state slot, handed off as
engine/model/families/granite_hybrid.py describes; a pipeline stage's pools number its own
layers from 0).

Tensor-parallel: the attention by heads as Llama's, the mixer by Mamba heads as Granite
4.0-H's (mamba2.py: groups of B and C split or, one group, kept whole with the gated norm's
squares summed across the ranks), the MLP by columns. Every multiplier is one number per
part, so each rank applies it to its slice alone: ssm_in_multiplier to the (replicated)
input, the mup vector's five factors to its rows of gate, x, B, C and dt (mamba2.py builds
the vector from the rank's part sizes), mlp_gate to its gate columns, and the output
multipliers (ssm_out, attention_out, mlp_down) after each all-reduce."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from llmserve.common.mamba2_config import FalconMultipliers
from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.layers import Attention, Linear, OpsModule, RMSNorm
from llmserve.engine.model.mamba2 import Mamba2Mixer
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import HFTensor
from llmserve.engine.model.ops import AttentionContext, LayerOps
from llmserve.engine.parallel.groups import TPGroup


def multipliers(config: ModelConfig) -> FalconMultipliers:
    return config.falcon_multipliers or FalconMultipliers()


class FalconMLP(OpsModule):
    """down_proj(up * silu(gate * mlp_gate)) * mlp_down, gate and up fused (HF's gate_proj,
    up_proj rows)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TPGroup):
        super().__init__(ops)
        m, size, bias = multipliers(config), config.intermediate_size // tp.size, config.mlp_bias
        self.tp = tp
        self.gate_scale, self.down_scale = m.mlp_gate, m.mlp_down
        self.gate_up_proj = Linear(config.hidden_size, [size, size], bias, tp, "output")
        self.down_proj = Linear(size, [config.hidden_size], bias, tp, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_scale != 1.0:
            gate, up = gate_up.chunk(2, dim=-1)
            gate_up = torch.cat((gate * self.gate_scale, up), dim=-1)
        out = self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(gate_up)))
        return out * self.down_scale if self.down_scale != 1.0 else out


class FalconH1DecoderLayer(nn.Module):
    """input_layernorm -> (mamba | self_attn) -> pre_ff_layernorm -> feed_forward; the residual
    adds fused into the norms as in DecoderLayer."""

    def __init__(
        self,
        config: ModelConfig,
        mamba: Mamba2Mixer,
        attn: Attention,
        ops: LayerOps,
        tp: TPGroup,
    ):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.m = multipliers(config)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.mamba = mamba
        self.self_attn = attn
        self.pre_ff_layernorm = RMSNorm(hidden, eps, ops)
        self.feed_forward = FalconMLP(config, ops, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.m
        hidden, residual = self.input_layernorm(hidden, residual)
        mixed = self.mamba(positions, hidden, ctx) * m.ssm_out
        attn_in = hidden * m.attention_in if m.attention_in != 1.0 else hidden
        mixed = mixed + self.self_attn(positions, attn_in, ctx) * m.attention_out
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Tensor-parallel over the attention heads, the Mamba heads and the MLP's columns (the
    module docstring); pipeline-parallel by layers (each stage's pools hold its own)."""

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        assert config.mamba2 is not None, "falcon_h1: config.json gave no mamba_* fields"
        start = self.shard.layers.start
        state = config.state_layer_index(layer) - config.state_layer_index(start)
        eps = config.rms_norm_eps
        mamba = Mamba2Mixer(config.hidden_size, config.mamba2, eps, state, tp, ops)
        kv = config.kv_layer_index(layer) - config.kv_layer_index(start)
        attn = Attention(config, kv, self.rotary_emb, ops, tp)
        return FalconH1DecoderLayer(config, mamba, attn, ops, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        scale = multipliers(self.config).lm_head
        return logits * scale if scale != 1.0 else logits

    def hf_tensors(self) -> Iterator[HFTensor]:
        """The Llama layout's names, the final norm as HF's `model.final_layernorm`."""
        for name, *rest in super().hf_tensors():
            yield (re.sub(r"^model\.norm\.", "model.final_layernorm.", name), *rest)  # type: ignore[misc]
