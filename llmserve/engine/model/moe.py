"""The mixture-of-experts block that stands where a dense layer's MLP stands (same call:
[tokens, hidden] in, [tokens, hidden] out, summed over the tensor-parallel ranks).

The router picks top-k experts per token (softmax, or GLM-4.5 / DeepSeek-V3's grouped sigmoid
router in `route_grouped`); the (token, expert) pairs are sorted by expert and each expert's
segment runs as one grouped product per weight (kernels/moe_reference.py, kernels/moe.cu on a
GPU). `Experts` stacks the local experts as w13 [E_local, 2 I, H] and w2 [E_local, H, I].
Under tensor parallelism each rank holds E / T experts whole and the partial outputs join the
all-reduce a dense MLP already makes. See docs/moe.md and
docs/parallelism.md#expert-parallelism-mixture-of-experts-models.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from llmserve.common.moe_config import MoEConfig
from llmserve.engine.model.layers import Linear, OpsModule, default_weight_loader
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels.moe_reference import route

HFTensor = tuple[str, nn.Module, nn.Parameter, int]


class Router(nn.Module):
    """The router's [E, H] weight, replicated on every rank. Not a `Linear`, so that packing and
    quantization (which replace every Linear) leave routing exactly as the checkpoint has it.
    corrected: DeepSeek's per-expert score-correction bias beside it; such a router stays in
    float32 whatever the model's dtype, as transformers keeps it (the biased scores of two
    experts can be closer than a bfloat16 step)."""

    def __init__(self, hidden_size: int, num_experts: int, corrected: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        if corrected:
            self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))

    def _apply(self, fn: Any, recurse: bool = True) -> Router:
        if self.e_score_correction_bias is None:
            return super()._apply(fn, recurse)
        # model.to(dtype) and to_empty run before the checkpoint loads: a float32 param then
        # takes the checkpoint's values unrounded.
        return super()._apply(lambda t: fn(t).float() if t.is_floating_point() else fn(t), recurse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.e_score_correction_bias is not None:
            return nn.functional.linear(x.float(), self.weight)
        return nn.functional.linear(x, self.weight)


def route_grouped(
    router_logits: torch.Tensor, bias: torch.Tensor, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc routing, as HF computes it (float32): sigmoid scores; the experts
    chosen by score + bias among the topk_groups groups whose two best biased scores sum
    highest; their unbiased scores as weights, renormalized if asked, times
    routed_scaling_factor. (weights float32 [T, k], expert ids int64 [T, k])."""
    scores = router_logits.float().sigmoid()
    choice = scores + bias.float()
    groups = choice.view(-1, moe.num_groups, moe.num_experts // moe.num_groups)
    group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, moe.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(groups.shape[-1], dim=1), float("-inf"))
    ids = torch.topk(choice, moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids


class Experts(nn.Module):
    """The experts `experts` of a block, stacked: w13 [E_local, 2 I, H], w2 [E_local, H, I].
    Shard s of w13 is local expert s // 2's gate (s even) or up (s odd) rows; shard s of w2 is
    local expert s's down projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, experts: range):
        super().__init__()
        self.experts, self.intermediate_size = experts, intermediate_size
        n = len(experts)
        self.w13 = nn.Parameter(torch.empty(n, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, intermediate_size))

    def shard(self, param: torch.Tensor, shard: int) -> torch.Tensor:
        """The view of w13 or w2 that HF tensor number `shard` fills (see the class)."""
        if param is self.w2:
            return param[shard]
        local, part = divmod(shard, 2)
        size = self.intermediate_size
        return param[local].narrow(0, part * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        default_weight_loader(self.shard(param, shard), loaded)

    def hf_tensors(self, stem: str, names: tuple[str, str, str]) -> Iterator[HFTensor]:
        """(HF name, self, parameter, shard) of each local expert's three tensors, every
        expert's gate first, then the ups, then the downs (a GGUF stacks each projection's
        experts in one tensor: read once, sliced E times); stem: the block's HF prefix
        ("model.layers.3.mlp.")."""
        params = (self.w13, self.w13, self.w2)
        for part, (name, param) in enumerate(zip(names, params, strict=True)):
            for local, expert in enumerate(self.experts):
                shard = local if param is self.w2 else 2 * local + part
                yield f"{stem}experts.{expert}.{name}.weight", self, param, shard


class SharedExpert(OpsModule):
    """A SwiGLU MLP beside the routed experts (Qwen2-MoE), split by columns across the
    tensor-parallel ranks like a dense MLP; its partial output is summed with the block's."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops: LayerOps, tp: TPGroup):
        super().__init__(ops)
        inter = intermediate_size // tp.size
        self.gate_up_proj = Linear(hidden_size, [inter, inter], False, tp, "output")
        self.down_proj = Linear(inter, [hidden_size], False, tp, "input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class SparseMoeBlock(OpsModule):
    """The MoE block of one layer (see the module docstring); forward(x) is summed over the
    tensor-parallel ranks, as a dense MLP's is."""

    def __init__(self, hidden_size: int, moe: MoEConfig, ops: LayerOps, tp: TPGroup | None = None):
        super().__init__(ops)
        self.tp = tp = tp or TPGroup()
        self.moe = moe
        self.gate = Router(hidden_size, moe.num_experts, corrected=moe.grouped)
        local = moe.expert_range(tp.rank, tp.size)
        # or, a quantized checkpoint's on a CPU, engine/model/kept_experts.py's KeptExperts
        self.experts: nn.Module = Experts(hidden_size, moe.intermediate_size, local)
        self.shared_expert: SharedExpert | None = None
        self.shared_expert_gate: Router | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(hidden_size, moe.shared_intermediate_size, ops, tp)
            if not moe.grouped:  # DeepSeek's shared experts are ungated
                self.shared_expert_gate = Router(hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        if bias is not None:
            weights, ids = route_grouped(self.gate(x), bias, self.moe)
        else:
            weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize)
        experts = self.experts
        if isinstance(experts, Experts):
            first = experts.experts.start
            out = self.ops.moe_experts(x, weights, ids, experts.w13, experts.w2, first)
        else:  # kept quantized on the CPU (engine/model/kept_experts.py)
            out = experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return self.tp.all_reduce(out)

    def hf_tensors(self, stem: str) -> Iterator[HFTensor]:
        """(HF name, module, parameter, shard) of every checkpoint tensor this rank's block
        reads. stem: the HF prefix of the layer's MLP ("model.layers.3.mlp."); Mixtral's block
        is named `block_sparse_moe` there instead."""
        stem = stem.removesuffix("mlp.") + f"{self.moe.hf_block}."
        yield f"{stem}gate.weight", self.gate, self.gate.weight, 0
        bias = self.gate.e_score_correction_bias
        if bias is not None:
            yield f"{stem}gate.e_score_correction_bias", self.gate, bias, 0
        if isinstance(self.experts, Experts):  # kept experts read theirs when they were made
            yield from self.experts.hf_tensors(stem, self.moe.hf_experts)
        if self.shared_expert is not None:
            # a projection kept quantized (engine/model/checkpoint_linear.py) read its own
            shared = "shared_experts" if self.moe.grouped else "shared_expert"
            proj, down = self.shared_expert.gate_up_proj, self.shared_expert.down_proj
            if isinstance(proj, Linear):
                for shard, part in enumerate(("gate_proj", "up_proj")):
                    yield f"{stem}{shared}.{part}.weight", proj, proj.weight, shard
            if isinstance(down, Linear):
                yield f"{stem}{shared}.down_proj.weight", down, down.weight, 0
        if self.shared_expert_gate is not None:
            gate = self.shared_expert_gate
            yield f"{stem}shared_expert_gate.weight", gate, gate.weight, 0
