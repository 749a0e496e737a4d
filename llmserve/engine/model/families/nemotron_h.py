"""Nemotron-H (NemotronHForCausalLM), after transformers' modeling_nemotron_h.py: single-mixer
blocks `h + mixer(norm(h))`, the mixer by config.layer_types a Mamba-2 layer
(engine/model/mamba2.py; its state handed off as engine/model/families/granite_hybrid.py
describes), GQA attention without rotary, an MLP down(relu(up(x))^2), or (Nemotron 3) an MoE:
DeepSeek-V3's grouped sigmoid router (engine/model/moe.py's `route_grouped`, the same math as
transformers' NemotronHTopkRouter), ungated squared-ReLU experts, in moe_latent_size's space
between fc1_latent_proj and fc2_latent_proj where the config has one, plus an ungated
shared expert. Checkpoint names under `backbone.` (embeddings, layers.N.norm / mixer,
norm_f); the experts' per expert (mixer.experts.E.up_proj / down_proj).

Tensor-parallel, an MoE block splits as the other MoE families' (engine/model/moe.py): each
rank holds E / T experts whole (MoEConfig.expert_range) and the shared expert's columns; the
router (its correction bias and grouped top-k) and the latent projections are replicated, so
every rank routes every token alike and runs its own experts' pairs; fc2_latent_proj (linear)
of a rank's partial sum plus its shared-expert part is summed in the block's one all-reduce."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.common.moe_config import MoEConfig
from llmserve.engine.model.families.granite_hybrid import STATE_LAYER, layer_index
from llmserve.engine.model.families.smollm3 import NoRotary
from llmserve.engine.model.layers import Attention, Linear, RMSNorm, default_weight_loader
from llmserve.engine.model.mamba2 import Mamba2Mixer
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.moe import HFTensor, Router, route_grouped
from llmserve.engine.model.ops import AttentionContext, LayerOps
from llmserve.engine.parallel.groups import TPGroup
from llmserve.kernels.moe_reference import grouped_linear, sort_by_expert


class Relu2MLP(nn.Module):
    """down_proj(relu(up_proj(x)) ** 2), ungated (of intermediate_size, default the config's)."""

    def __init__(self, config: ModelConfig, tp: TPGroup, intermediate_size: int | None = None):
        super().__init__()
        bias = config.mlp_bias
        width = (intermediate_size or config.intermediate_size) // tp.size
        self.tp = tp
        self.up_proj = Linear(config.hidden_size, [width], bias, tp, "output")
        self.down_proj = Linear(width, [config.hidden_size], bias, tp, "input")

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's columns' part of the output (the whole of it on one rank)."""
        return self.down_proj(torch.relu(self.up_proj(x)).square())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))


class UngatedExperts(nn.Module):
    """The experts `experts` (tensor-parallel, this rank's; else all E) stacked: up_proj
    [E_local, I, D] and down_proj [E_local, D, I] (D: hidden_size or moe_latent_size); shard s
    of either is local expert s's tensor."""

    def __init__(self, experts: range, width: int, intermediate_size: int):
        super().__init__()
        self.experts = experts
        n = len(experts)
        self.up_proj = nn.Parameter(torch.empty(n, intermediate_size, width))
        self.down_proj = nn.Parameter(torch.empty(n, width, intermediate_size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        default_weight_loader(param[shard], loaded)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each token's sum over its routed experts held here: the (token, expert) pairs of
        local experts sorted by expert, one product per expert segment and weight
        (kernels/moe_reference.py's grouping)."""
        pairs, tokens, counts = sort_by_expert(ids, self.experts.start, len(self.experts))
        out = torch.zeros_like(x)
        if not pairs.numel():
            return out
        hidden = torch.relu(grouped_linear(x.index_select(0, tokens), self.up_proj, counts))
        rows = grouped_linear(hidden.square(), self.down_proj, counts)
        rows = rows * weights.flatten().index_select(0, pairs).unsqueeze(1).to(rows.dtype)
        return out.index_add_(0, tokens, rows)


class NemotronMoE(nn.Module):
    """The MoE block (the module docstring); HF's names gate (weight, e_score_correction_bias),
    experts, shared_experts, fc1_latent_proj / fc2_latent_proj."""

    def __init__(self, config: ModelConfig, moe: MoEConfig, tp: TPGroup):
        super().__init__()
        self.moe, self.tp, hidden = moe, tp, config.hidden_size
        self.gate = Router(hidden, moe.num_experts, corrected=True)
        width = moe.latent_size or hidden
        local = moe.expert_range(tp.rank, tp.size)
        self.experts = UngatedExperts(local, width, moe.intermediate_size)
        self.shared_experts = Relu2MLP(config, tp, moe.shared_intermediate_size)
        self.fc1_latent_proj: Linear | None = None
        self.fc2_latent_proj: Linear | None = None
        if moe.latent_size is not None:
            self.fc1_latent_proj = Linear(hidden, [width], config.mlp_bias)
            self.fc2_latent_proj = Linear(width, [hidden], config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.gate.e_score_correction_bias
        assert bias is not None
        weights, ids = route_grouped(self.gate(x), bias, self.moe)
        routed = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts(routed, weights, ids)  # this rank's experts' part
        if self.fc2_latent_proj is not None:  # linear: of each rank's part (`weight_loader`)
            routed = self.fc2_latent_proj(routed)
        return self.tp.all_reduce(routed + self.shared_experts.partial(x))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """fc2_latent_proj's bias (hf_tensors hands it here): rank 0's alone, so that it is
        added once in the sum of the ranks' parts."""
        default_weight_loader(param, loaded if self.tp.rank == 0 else torch.zeros_like(loaded))


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
        if isinstance(self.mixer, (Relu2MLP, NemotronMoE)):
            return self.mixer(hidden), residual
        return self.mixer(positions, hidden, ctx), residual


class NemotronHForCausalLM(LlamaForCausalLM):
    """Tensor-parallel over the Mamba heads, the attention heads, the MLP's columns and the MoE
    blocks' experts (the module docstring); pipeline-parallel by layers (each stage's pools
    hold its own)."""

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        kind = config.layer_types[layer]
        mixer: nn.Module
        if kind == STATE_LAYER:
            assert config.mamba2 is not None, "nemotron_h: config.json gave no mamba fields"
            index = layer_index(config, layer, self.shard.layers.start)
            eps = config.rms_norm_eps
            mixer = Mamba2Mixer(config.hidden_size, config.mamba2, eps, index, tp, ops)
        elif kind == "mlp":
            mixer = Relu2MLP(config, tp)
        elif kind == "moe":
            assert config.moe is not None, "nemotron_h: config.json gave no MoE fields"
            mixer = NemotronMoE(config, config.moe, tp)
        else:  # attention blocks only keep KV
            index = layer_index(config, layer, self.shard.layers.start)
            mixer = Attention(config, index, NoRotary(config, ops), ops, tp)
        return NemotronBlock(config, mixer, ops)

    def hf_tensors(self) -> Iterator[HFTensor]:
        """The Llama layout's names moved under `backbone.` (embeddings, norm_f); the stacked
        experts' tensors read per expert (this rank's experts)."""
        renames = (
            (r"^model\.embed_tokens\.", "backbone.embeddings."),
            (r"^model\.norm\.", "backbone.norm_f."),
            (r"^model\.", "backbone."),
        )
        owners = {id(m.fc2_latent_proj): m for m in self.modules() if isinstance(m, NemotronMoE)}
        for name, module, param, shard in super().hf_tensors():
            if name.endswith("fc2_latent_proj.bias"):
                module = owners[id(module)]
            for pattern, new in renames:
                name, hits = re.subn(pattern, new, name)
                if hits:
                    break
            if not isinstance(module, UngatedExperts):
                yield name, module, param, shard
                continue
            stem, _, kind = name.rpartition(".")
            for local, e in enumerate(module.experts):
                yield f"{stem}.{e}.{kind}.weight", module, param, local
