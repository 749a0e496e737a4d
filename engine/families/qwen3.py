"""Qwen3: Llama's layers with an RMSNorm over each head's q and k before the rotary."""

from __future__ import annotations

from torch import nn

from common.model_config import ModelConfig
from engine.layers import Attention, RMSNorm
from engine.model import LlamaForCausalLM
from engine.ops import LayerOps
from engine.parallel import TPGroup


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return Attention(
            config, local, self.rotary_for(layer), ops, tp,
            window=config.layer_window(layer), qk_norm=RMSNorm,
        )  # fmt: skip
