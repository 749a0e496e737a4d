"""MoE experts kept quantized on the CPU: `keep_expert_weights` swaps, before the load, each
experts module whose checkpoint tensors are all in a kept form (engine/model/kept_weights.py:
W4A16, W8A16, FP8, MXFP4) for `KeptExperts`, one CheckpointLinear
(engine/model/checkpoint_linear.py, kernels/cpu_wq.cpp) per local expert and projection, so the
load never widens them to float32. Two experts modules are read:

- engine/model/moe.py's `Experts` (Mixtral, Qwen2/3-MoE, GLM-4.5, DeepSeek-V3): each expert's
  gate and up rows one linear (SiLU-and-mul after it), its down projection another;
- gpt-oss's `BiasedExperts` (engine/model/families/gpt_oss.py): each expert's interleaved
  gate_up rows with their bias, the clamped SwiGLU, then down with its bias; from stacked
  [E, N, K] tensors (gpt-oss's MXFP4 `*_blocks` / `*_scales`, via CheckpointView.kept_stack).

An experts module with any tensor not kept (2-bit, a fused 3-D compressed-tensors tensor) loads
dequantized as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.checkpoint_linear import CheckpointLinear, can_keep
from llmserve.engine.model.families.gpt_oss import BiasedExperts, clamped_swiglu
from llmserve.engine.model.kept_weights import KeptWeight
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import Experts, HFTensor
from llmserve.kernels.moe_reference import sort_by_expert
from llmserve.kernels.reference import silu_and_mul

Activation = Callable[[torch.Tensor], torch.Tensor]


class KeptExperts(nn.Module):
    """The local experts `experts` as stored: expert e's rows go through gate_up[e], the
    activation, then down[e] (each a CheckpointLinear, biases inside). Called as the module it
    replaces: forward(x, weights, ids) -> the weighted sum of each token's local experts."""

    def __init__(
        self,
        experts: range,
        gate_up: list[CheckpointLinear],
        down: list[CheckpointLinear],
        activation: Activation,
    ):
        super().__init__()
        self.experts = experts
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)
        self.activation = activation

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """As kernels/moe_reference.moe_experts: pairs sorted by expert, one kernel call per
        projection and expert segment, rows scaled and added back into their tokens."""
        pairs, tokens, counts = sort_by_expert(ids, self.experts.start, len(self.experts))
        out = torch.zeros_like(x)
        if not pairs.numel():
            return out
        rows = x.index_select(0, tokens)
        parts, start = [], 0
        for e, count in enumerate(counts):
            if count:
                segment = rows[start : start + count]
                parts.append(self.down[e](self.activation(self.gate_up[e](segment))))
                start += count
        y = torch.cat(parts) if len(parts) != 1 else parts[0]
        y = y * weights.flatten().index_select(0, pairs).unsqueeze(1).to(y.dtype)
        return out.index_add_(0, tokens, y)

    @property
    def num_linears(self) -> int:
        return len(self.gate_up) + len(self.down)


def _stacked_experts(
    experts: Experts, items: list[HFTensor], weights: CheckpointView
) -> KeptExperts | None:
    """moe.Experts' kept form: items are its (name, module, param, shard) from hf_tensors."""
    names = {(param is experts.w2, shard): name for name, _, param, shard in items}
    gate_up, down = [], []
    for local in range(len(experts.experts)):
        parts = [weights.kept(names[(False, 2 * local + p)]) for p in (0, 1)]
        down_part = weights.kept(names[(True, local)])
        kept = [w for w in (*parts, down_part) if w is not None]
        if len(kept) != 3:
            return None
        gate_up.append(CheckpointLinear(kept[:2], None))
        down.append(CheckpointLinear(kept[2:], None))
    return KeptExperts(experts.experts, gate_up, down, silu_and_mul)


def _biased_experts(
    experts: BiasedExperts, items: list[HFTensor], weights: CheckpointView
) -> KeptExperts | None:
    """gpt-oss's BiasedExperts' kept form, from its stacked tensors and their biases."""
    names = {param: name for name, _, param, _ in items}
    local = slice(experts.experts.start, experts.experts.stop)
    stacks: list[list[KeptWeight]] = []
    for param in (experts.gate_up_proj, experts.down_proj):
        stack = weights.kept_stack(names[param])
        if stack is None:
            return None
        stacks.append(stack[local])
    gate_up_bias = weights[names[experts.gate_up_proj_bias]][local].float()
    down_bias = weights[names[experts.down_proj_bias]][local].float()
    gate_up = [CheckpointLinear([w], b) for w, b in zip(stacks[0], gate_up_bias, strict=True)]
    down = [CheckpointLinear([w], b) for w, b in zip(stacks[1], down_bias, strict=True)]
    swiglu = functools.partial(clamped_swiglu, alpha=experts.alpha, limit=experts.limit)
    return KeptExperts(experts.experts, gate_up, down, swiglu)


def keep_expert_weights(model: LlamaForCausalLM, weights: CheckpointView) -> int:
    """Before the load: each experts module whose tensors `weights` holds in a kept form
    becomes a KeptExperts over them; the number of expert linears swapped in (0 where
    checkpoint_linear.can_keep says no: a float checkpoint, no kernel, tensor parallelism)."""
    if not can_keep(model, weights):
        return 0
    items: dict[int, list[HFTensor]] = {}
    for item in model.hf_tensors():
        if isinstance(item[1], (Experts, BiasedExperts)):
            items.setdefault(id(item[1]), []).append(item)
    swapped = 0
    for name, module in list(model.named_modules()):
        if id(module) not in items:
            continue
        if isinstance(module, Experts):
            kept = _stacked_experts(module, items[id(module)], weights)
        else:
            assert isinstance(module, BiasedExperts)
            kept = _biased_experts(module, items[id(module)], weights)
        if kept is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, kept)
            swapped += kept.num_linears
    return swapped
