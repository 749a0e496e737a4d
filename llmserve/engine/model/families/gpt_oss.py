"""gpt-oss: Llama's attention with q/k/v/o biases and attention sinks (engine/layers.Attention
reads config.attention_sinks), sliding and full layers from config.layer_types, and in every
layer a mixture of experts with a biased router and biased experts under the clamped SwiGLU:

    logits = router(x) (+ bias);  the top-k logits, softmaxed: weights [T, k]
    per chosen expert e:  gate_up = x W_gu[e] + b_gu[e]      gate, up = gate_up[0::2], [1::2]
                          h = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g),
                              g = clamp(gate, max=limit)
                          out += weight * (h W_d[e] + b_d[e])

The experts keep transformers' names (gate_up_proj [E, H, 2 I] with interleaved gate / up
columns, down_proj [E, I, H], their biases), loaded into kernels/moe.cu's layout. On a GPU with
the CUDA kernels the products run in moe.cu (its gpt-oss form: biases and this activation; no
host synchronization, so decode steps are captured in CUDA graphs); else
kernels/moe_reference.py's grouped products. gpt-oss's own MXFP4 checkpoint stores each expert
tensor transposed ([E, 2 I, H], [E, H, I]) as `X_blocks` / `X_scales` along the input
dimension: read through `Mxfp4Experts`, dequantized at load, or on a CPU kept as stored
(engine/model/kept_experts.py, which runs the interleaved columns through `clamped_swiglu`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.common.moe_config import MoEConfig
from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.checkpoint_schemes import Mxfp4
from llmserve.engine.model.layers import default_weight_loader
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import LayerOps, OpsModule
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels.moe_reference import ClampedSwiGLU, route


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of the interleaved gate / up columns (see the module)."""
    gate = gate_up[..., 0::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


class BiasedRouter(nn.Module):
    """The router's weight [E, H] and bias [E]; not a Linear, so packing and quantization
    leave routing as the checkpoint has it."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


class BiasedExperts(OpsModule):
    """The experts `experts` (this rank's, under expert parallelism: common/moe_config.py's
    expert_range) with their biases, stored as kernels/moe.cu reads them: gate_up_proj
    [E, 2 I, H] (each expert's gate rows, then its up rows), its bias [E, 2 I] alike,
    down_proj [E, H, I], its bias [E, H]. The weight loader turns transformers' fused layout
    (see the module) into it."""

    def __init__(self, hidden_size: int, moe: MoEConfig, experts: range, ops: LayerOps):
        super().__init__(ops)
        assert moe.clamped_swiglu is not None
        self.alpha, self.limit = moe.clamped_swiglu
        self.experts = experts
        num, inter = len(experts), moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden_size))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, inter))
        self.down_proj_bias = nn.Parameter(torch.empty(num, hidden_size))

    def hf_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape transformers gives `param`'s tensor (the weights transposed)."""
        if param is self.gate_up_proj or param is self.down_proj:
            return param.shape[0], param.shape[2], param.shape[1]
        return tuple(param.shape)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """This rank's experts of transformers' tensor, in the kernel's layout: gate and up
        columns (interleaved) into gate rows then up rows, down transposed."""
        loaded = loaded[self.experts.start : self.experts.stop]
        if param is self.gate_up_proj or param is self.gate_up_proj_bias:
            loaded = torch.cat((loaded[..., 0::2], loaded[..., 1::2]), dim=-1)
        if param is self.gate_up_proj or param is self.down_proj:
            loaded = loaded.transpose(1, 2)
        default_weight_loader(param, loaded, shard)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's local experts (the other ranks' experts add theirs
        in the block's all-reduce): kernels/moe.cu through KernelOps (no host synchronization),
        the grouped torch products of kernels/moe_reference.py otherwise."""
        oss = ClampedSwiGLU(self.gate_up_proj_bias, self.down_proj_bias, self.alpha, self.limit)
        return self.ops.moe_experts(
            x, weights, ids, self.gate_up_proj, self.down_proj, self.experts.start, oss
        )


class GptOssMoeBlock(nn.Module):
    """gpt-oss's MLP: router, then the experts (module names as transformers')."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops: LayerOps, tp: TPGroup):
        super().__init__()
        self.moe, self.tp = moe, tp
        self.router = BiasedRouter(hidden_size, moe.num_experts)
        local = moe.expert_range(tp.rank, tp.size)
        self.experts = BiasedExperts(hidden_size, moe, local, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # softmax over the top-k logits equals the top-k of the softmax, renormalized
        weights, ids = route(self.router(x), self.moe.top_k, renormalize=True)
        return self.tp.all_reduce(self.experts(x, weights, ids))


class GGUFExperts(Mapping[str, torch.Tensor]):
    """A `gpt-oss` GGUF's tensors under transformers' names where llama.cpp's converter split or
    transposed them: the experts' gate and up ([E, I, H] each, biases [E, I]) interleaved back
    into gate_up_proj [E, H, 2 I] (and its bias), down [E, H, I] transposed to [E, I, H], the
    sinks `sinks.weight` as `sinks`. An HF checkpoint passes through unchanged."""

    EXPERTS = re.compile(r"(.*\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?")

    def __init__(self, weights: Mapping[str, torch.Tensor]):
        self.weights = weights
        stems = {n.rsplit(".", 2)[0] for n in weights if n.endswith("experts.gate_proj.weight")}
        joined = [f"{s}.{p}{b}" for s in stems for p in ("gate_up_proj", "down_proj")
                  for b in ("", "_bias")]  # fmt: skip
        sinks = [n.removesuffix(".weight") for n in weights if n.endswith("sinks.weight")]
        self.names = [*weights, *joined, *sinks]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.weights:
            return self.weights[name]
        if name.endswith(".sinks"):
            return self.weights[name + ".weight"]
        m = self.EXPERTS.fullmatch(name)
        if m is None:
            raise KeyError(name)
        kind = ".bias" if m[3] else ".weight"
        if m[2] == "down_proj":
            down = self.weights[f"{m[1]}down_proj{kind}"]
            return down if m[3] else down.transpose(1, 2)
        gate, up = (self.weights[f"{m[1]}{p}{kind}"] for p in ("gate_proj", "up_proj"))
        pairs = torch.stack((gate, up), dim=-2 if m[3] else -1)  # [E, I, H, 2] / [E, 2, I]
        if m[3]:
            return pairs.transpose(-1, -2).reshape(gate.shape[0], -1)
        return pairs.permute(0, 2, 1, 3).reshape(gate.shape[0], gate.shape[2], -1)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class GptOssForCausalLM(LlamaForCausalLM):
    """Tensor-parallel, the attention splits by heads (the sinks too) and the experts whole
    across the ranks (expert parallelism, as engine/model/moe.py)."""

    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if isinstance(weights, CheckpointView) and isinstance(weights.fmt, Mxfp4):
            return Mxfp4Experts(weights)
        return GGUFExperts(super().checkpoint_view(weights))

    def make_mlp(self, config: ModelConfig, layer: int, ops: LayerOps, tp: TPGroup) -> nn.Module:
        assert config.moe is not None, "gpt-oss: config.json gave no experts"
        return GptOssMoeBlock(config.hidden_size, config.moe, ops, tp)


class Mxfp4Experts(Mapping[str, torch.Tensor]):
    """An MXFP4 checkpoint's experts in transformers' float orientation: each quantized
    tensor (`experts.gate_up_proj`, stored [E, 2 I, H]) comes back transposed, [E, H, 2 I]."""

    def __init__(self, weights: CheckpointView):
        self.weights = weights

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self.weights[name]
        return tensor.transpose(-1, -2) if name in self.weights.quantized else tensor

    def __contains__(self, name: object) -> bool:
        return name in self.weights

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)
