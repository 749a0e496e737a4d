"""Gemma 2 and Gemma 3 (text): every norm scales by (1 + w) and the layers are sandwiched
(norms before and after attention and MLP); Gemma 3 normalizes each head's q and k. The rest
(embedding scale, gelu-tanh, query_pre_attn_scalar, soft-caps, windows, the sliding layers'
rope base) is config data the shared layers read."""

from __future__ import annotations

from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.layers import Attention, SandwichDecoderLayer, UnitOffsetRMSNorm
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.parallel.groups import TPGroup


class Gemma2ForCausalLM(LlamaForCausalLM):
    norm_class = UnitOffsetRMSNorm

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return SandwichDecoderLayer(
            config, local, self.rotary_for(layer), ops, tp,
            attention=self.make_attention(config, layer, local, ops, tp),
            mlp=self.make_mlp(config, layer, ops, tp),
            norm=self.norm_class,
        )  # fmt: skip


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return Attention(
            config, local, self.rotary_for(layer), ops, tp,
            window=config.layer_window(layer), qk_norm=UnitOffsetRMSNorm,
        )  # fmt: skip
