"""The mixture-of-experts families' models: their families' layers with a SparseMoeBlock
(engine/model/moe.py) where config.moe says a layer is sparse, and a dense MLP elsewhere. The block
stacks its experts' weights, so it names its checkpoint tensors itself (`hf_tensors`)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.families.qwen3 import Qwen3ForCausalLM
from llmserve.engine.model.layers import MLP, Attention, RMSNorm
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import HFTensor, SparseMoeBlock
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.parallel.groups import TPGroup


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

    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        return StackedExperts(super().checkpoint_view(weights))


class StackedExperts(Mapping[str, torch.Tensor]):
    """A checkpoint whose experts may be stacked, as a GGUF stores them (common/families/moe.py
    maps `ffn_gate_exps` to `mlp.experts.gate_proj`, [E, I, H]), seen under the per-expert names
    the blocks ask for (`mlp.experts.3.gate_proj.weight` is row 3 of it). The last stacked
    tensor read is kept, so each is read (and dequantized) once while its experts load in order.
    A GGUF's shared-expert gate, a vector [H], comes back as HF's [1, H]; its router correction
    bias (`gate.e_score_correction.bias`, GLM-4.5's) as HF's `gate.e_score_correction_bias`."""

    EXPERT = re.compile(r"(.*\.experts\.)(\d+)\.(\w+\.weight)")

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights
        self.names = set(weights)
        self.cached: tuple[str, torch.Tensor] | None = None

    def stacked(self, name: str) -> tuple[str, int] | None:
        """(the stacked tensor's name, the expert's row) for a per-expert name it covers."""
        m = self.EXPERT.fullmatch(name)
        if m is None or name in self.names or m[1] + m[3] not in self.names:
            return None
        return m[1] + m[3], int(m[2])

    @staticmethod
    def bias_source(name: str) -> str:
        """The GGUF name of the router's correction bias (others: as they are)."""
        if name.endswith("e_score_correction_bias"):
            return name.removesuffix("_bias") + ".bias"
        return name

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names and self.bias_source(name) in self.names:
            return self.weights[self.bias_source(name)]
        where = self.stacked(name)
        if where is None:
            tensor = self.weights[name]
            if name.endswith("shared_expert_gate.weight") and tensor.dim() == 1:
                tensor = tensor.unsqueeze(0)
            return tensor
        if self.cached is None or self.cached[0] != where[0]:
            self.cached = (where[0], self.weights[where[0]])
        return self.cached[1][where[1]]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        known = name in self.names or self.bias_source(name) in self.names
        return known or self.stacked(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


class MixtralForCausalLM(SparseLayers):
    pass


class Qwen2MoeForCausalLM(SparseLayers):
    pass


class Qwen3MoeForCausalLM(SparseLayers, Qwen3ForCausalLM):
    pass


class Glm4MoeForCausalLM(SparseLayers):
    """GLM-4.5: GQA with partial rotary and, with use_qk_norm, Qwen3's q/k norms."""

    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        return Attention(
            config, local, self.rotary_for(layer), ops, tp,
            window=config.layer_window(layer), qk_norm=RMSNorm if config.qk_norm else None,
        )  # fmt: skip
