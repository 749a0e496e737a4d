"""The mixture-of-experts families' models: their families' layers with a SparseMoeBlock
(engine/moe.py) where config.moe says a layer is sparse, and a dense MLP elsewhere. The block
stacks its experts' weights, so it names its checkpoint tensors itself (`hf_tensors`)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from common.model_config import ModelConfig
from engine.families.qwen3 import Qwen3ForCausalLM
from engine.layers import MLP
from engine.model import LlamaForCausalLM
from engine.moe import HFTensor, SparseMoeBlock
from engine.ops import LayerOps
from engine.parallel import TPGroup


class SparseLayers(LlamaForCausalLM):
    """make_mlp and hf_tensors for a model whose config has `moe`."""

    def make_mlp(self, config: ModelConfig, layer: int, ops: LayerOps, tp: TPGroup) -> nn.Module:
        assert config.moe is not None, f"{config.family}: config.json gave no experts"
        if not config.moe.is_sparse(layer):
            return MLP(config, ops, tp)
        return SparseMoeBlock(config.hidden_size, config.moe, ops, tp)

    def hf_tensors(self) -> Iterator[HFTensor]:
        """The dense modules' tensors as the Llama layout names them, then each sparse block's
        (its router, each local expert's gate / up / down, the shared expert)."""
        blocks = {
            name: module
            for name, module in self.named_modules()
            if isinstance(module, SparseMoeBlock)
        }
        inside = {id(m) for block in blocks.values() for m in block.modules()}
        for item in super().hf_tensors():
            if id(item[1]) not in inside:
                yield item
        for name, block in blocks.items():
            yield from block.hf_tensors(f"model.{name}.")


class MixtralForCausalLM(SparseLayers):
    pass


class Qwen2MoeForCausalLM(SparseLayers):
    pass


class Qwen3MoeForCausalLM(SparseLayers, Qwen3ForCausalLM):
    pass
