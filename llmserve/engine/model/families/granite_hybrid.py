"""Granite 4.0-H (GraniteMoeHybridForCausalLM), after transformers' modeling_granitemoehybrid.py:
Mamba-2 layers (engine/model/mamba2.py) and GQA attention layers by config.layer_types,
rotary only with position_embedding_type "rope" (the released models use none), and in every
layer an MoE (softmax over the top-k router logits) plus an ungated shared MLP. Granite's
multipliers: embeddings x embedding_multiplier; softmax scale attention_multiplier; each
mixer's and MLP's output x residual_multiplier before its residual add; logits /
logits_scaling.

State handoff (what the scheduler's state slots provide): the family declares, per Mamba
layer and request, conv [conv_dim, d_conv - 1] and SSM [heads, head_dim, d_state]
(ModelConfig.mamba2.conv_shape / ssm_shape); Mamba layer i (counting Mamba layers only) is
state layer i of a pool [num_state_layers, num_slots, ...]; each step a Mamba layer reads a
row's pair through ctx.state.read(state_idx, row, fresh) (zeros on a request's first chunk),
runs its chunk (chunked form; one token: the recurrent form) and writes it back with
ctx.state.write. Attention layer j (counting attention layers only) is KV-pool layer j.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.common.moe_config import MoEConfig
from llmserve.engine.model.families.smollm3 import NoRotary
from llmserve.engine.model.layers import (
    Attention,
    Linear,
    OpsModule,
    RMSNorm,
    default_weight_loader,
)
from llmserve.engine.model.mamba2 import Mamba2Mixer, RowParts
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import Router
from llmserve.engine.model.ops import AttentionContext, LayerOps
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels.moe_reference import route

STATE_LAYER = "mamba"


def layer_index(config: ModelConfig, layer: int, start: int = 0) -> int:
    """Layer `layer`'s index among the layers of its kind from layer `start` on (a pipeline
    stage's first: its pools hold its own layers): the state pool's for a Mamba layer, the KV
    pool's for any other (Nemotron-H's MLP and MoE blocks have none: ModelConfig counts)."""
    if config.layer_types[layer] == STATE_LAYER:
        return config.state_layer_index(layer) - config.state_layer_index(start)
    return config.kv_layer_index(layer) - config.kv_layer_index(start)


class Stacked(nn.Module):
    """One stacked expert tensor (HF's `input_linear.weight` [E, 2 I, H] or `output_linear.weight`
    [E, H, I]); tensor-parallel, the experts `local` (expert parallelism)."""

    def __init__(self, local: range, *shape: int):
        super().__init__()
        self.local = local
        self.weight = nn.Parameter(torch.empty(len(local), *shape))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        default_weight_loader(param, loaded[self.local.start : self.local.stop], shard)


class GraniteRouter(nn.Module):
    """HF's `router.layer`: the router's [E, H] weight one module down."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.layer = Router(hidden_size, num_experts)


class GraniteMoE(OpsModule):
    """The routed experts (gate rows first in each expert's input_linear, as our w13);
    tensor-parallel, this rank's experts (its part of the sum, all-reduced by the layer)."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops: LayerOps, tp: TPGroup):
        super().__init__(ops)
        self.moe = moe
        self.router = GraniteRouter(hidden_size, moe.num_experts)
        local, i = moe.expert_range(tp.rank, tp.size), moe.intermediate_size
        self.input_linear = Stacked(local, 2 * i, hidden_size)
        self.output_linear = Stacked(local, hidden_size, i)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router.layer(x), self.moe.top_k, self.moe.renormalize)
        w13, w2 = self.input_linear.weight, self.output_linear.weight
        first = self.input_linear.local.start
        return self.ops.moe_experts(x, weights, ids, w13, w2, first)


class SharedMLP(OpsModule):
    """output_linear(silu(gate) * up) with [gate | up] = input_linear(x); tensor-parallel, this
    rank's columns of each (its part of the sum, all-reduced by the layer)."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: LayerOps, tp: TPGroup):
        super().__init__(ops)
        half = (intermediate_size, True)
        self.input_linear = RowParts([half, half], (hidden_size,), False, tp)
        width = intermediate_size // tp.size
        self.output_linear = Linear(width, [hidden_size], False, tp, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.ops.silu_and_mul(self.input_linear(x)))


class GraniteDecoderLayer(nn.Module):
    """Pre-norm mixer (`mamba` or `self_attn`) and MLP (`block_sparse_moe` + `shared_mlp`),
    each output times residual_multiplier; the residual adds fused into the norms as in
    DecoderLayer."""

    def __init__(
        self, config: ModelConfig, mixer: nn.Module, is_mamba: bool, ops: LayerOps, tp: TPGroup
    ):
        super().__init__()
        self.tp = tp
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.scale = config.residual_multiplier
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.mamba: nn.Module | None = mixer if is_mamba else None
        self.self_attn: nn.Module | None = None if is_mamba else mixer
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        moe = config.moe
        self.block_sparse_moe = None if moe is None else GraniteMoE(hidden, moe, ops, tp)
        self.shared_mlp = SharedMLP(hidden, config.intermediate_size, ops, tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        mixer = self.mamba if self.mamba is not None else self.self_attn
        assert mixer is not None
        hidden, residual = self.post_attention_layernorm(
            mixer(positions, hidden, ctx) * self.scale, residual
        )
        out = self.shared_mlp(hidden)
        if self.block_sparse_moe is not None:
            out = out + self.block_sparse_moe(hidden)
        return self.tp.all_reduce(out) * self.scale, residual


class GraniteMoeHybridForCausalLM(LlamaForCausalLM):
    """Tensor-parallel over the Mamba heads (engine/model/mamba2.py), the attention heads, the
    shared MLP's columns and the experts; pipeline-parallel by layers (each stage's pools hold
    its own)."""

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        index = layer_index(config, layer, self.shard.layers.start)
        mixer: nn.Module
        if config.layer_types[layer] == STATE_LAYER:
            assert config.mamba2 is not None, "granite_hybrid: config.json gave no mamba_* fields"
            eps = config.rms_norm_eps
            mixer = Mamba2Mixer(config.hidden_size, config.mamba2, eps, index, tp, ops)
        else:
            rotary = NoRotary(config, ops) if layer in config.nope_layers else self.rotary_emb
            mixer = Attention(config, index, rotary, ops, tp)
        is_mamba = config.layer_types[layer] == STATE_LAYER
        return GraniteDecoderLayer(config, mixer, is_mamba, ops, tp)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling
