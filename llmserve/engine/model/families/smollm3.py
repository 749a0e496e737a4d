"""SmolLM3: Llama's layers; the NoPE ones (ModelConfig.nope_layers) attend without rotary."""

from __future__ import annotations

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.layers import Attention
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.model.rotary import RotaryEmbedding
from llmserve.engine.parallel.groups import TPGroup


class NoRotary(RotaryEmbedding):
    """Rotates nothing. Its rotary_dim of 0 keeps fused paths that read the cos/sin cache
    themselves (engine/model/cpu_fused.py: anything but a whole-head rotary) off these layers."""

    def __init__(self, config: ModelConfig, ops: LayerOps):
        super().__init__(config, 1, ops)
        self.rotary_dim = 0

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        rotary = NoRotary(config, ops) if layer in config.nope_layers else self.rotary_for(layer)
        return Attention(config, local, rotary, ops, tp, window=config.layer_window(layer))
