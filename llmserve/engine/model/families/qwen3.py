"""Qwen3: Llama's layers with an RMSNorm over each head's q and k before the rotary."""

from __future__ import annotations

from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.layers import Attention, RMSNorm
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.parallel.groups import TPGroup


class Qwen3ForCausalLM(LlamaForCausalLM):
    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return Attention(
            config, local, self.rotary_for(layer), ops, tp,
            window=config.layer_window(layer), qk_norm=RMSNorm,
        )  # fmt: skip
