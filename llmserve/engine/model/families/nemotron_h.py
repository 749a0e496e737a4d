"""Nemotron-H (NemotronHForCausalLM), after transformers' modeling_nemotron_h.py: single-mixer
blocks `h + mixer(norm(h))`, the mixer by config.layer_types a Mamba-2 layer
(engine/model/mamba2.py; its state handed off as engine/model/families/granite_hybrid.py
describes), GQA attention without rotary, or an MLP down(relu(up(x))^2). Checkpoint names
under `backbone.` (embeddings, layers.N.norm / mixer, norm_f)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.families.granite_hybrid import STATE_LAYER, layer_index
from llmserve.engine.model.families.smollm3 import NoRotary
from llmserve.engine.model.layers import Attention, Linear, RMSNorm
from llmserve.engine.model.mamba2 import Mamba2Mixer
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import HFTensor
from llmserve.engine.model.ops import AttentionContext, LayerOps
from llmserve.engine.parallel.groups import TPGroup


class Relu2MLP(nn.Module):
    """down_proj(relu(up_proj(x)) ** 2), ungated."""

    def __init__(self, config: ModelConfig, tp: TPGroup):
        super().__init__()
        bias, width = config.mlp_bias, config.intermediate_size // tp.size
        self.tp = tp
        self.up_proj = Linear(config.hidden_size, [width], bias, tp, "output")
        self.down_proj = Linear(width, [config.hidden_size], bias, tp, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(torch.relu(self.up_proj(x)).square()))


class NemotronBlock(nn.Module):
    """norm then mixer; the residual add fused into the next block's norm (as DecoderLayer)."""

    def __init__(self, config: ModelConfig, mixer: nn.Module, ops: LayerOps):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mixer = mixer

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm(hidden, residual)
        if isinstance(self.mixer, Relu2MLP):
            return self.mixer(hidden), residual
        return self.mixer(positions, hidden, ctx), residual


class NemotronHForCausalLM(LlamaForCausalLM):
    """Tensor-parallel over the Mamba heads, the attention heads and the MLP's columns;
    pipeline-parallel by layers (each stage's pools hold its own)."""

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        kind = config.layer_types[layer]
        index = layer_index(config, layer, self.shard.layers.start)
        mixer: nn.Module
        if kind == STATE_LAYER:
            assert config.mamba2 is not None, "nemotron_h: config.json gave no mamba fields"
            eps = config.rms_norm_eps
            mixer = Mamba2Mixer(config.hidden_size, config.mamba2, eps, index, tp)
        elif kind == "mlp":
            mixer = Relu2MLP(config, tp)
        else:
            mixer = Attention(config, index, NoRotary(config, ops), ops, tp)
        return NemotronBlock(config, mixer, ops)

    def hf_tensors(self) -> Iterator[HFTensor]:
        """The Llama layout's names moved under `backbone.` (embeddings, norm_f)."""
        renames = (
            (r"^model\.embed_tokens\.", "backbone.embeddings."),
            (r"^model\.norm\.", "backbone.norm_f."),
            (r"^model\.", "backbone."),
        )
        for name, *rest in super().hf_tensors():
            for pattern, new in renames:
                name, hits = re.subn(pattern, new, name)
                if hits:
                    break
            yield (name, *rest)  # type: ignore[misc]
