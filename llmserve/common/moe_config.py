"""The mixture-of-experts shape of a model, read from its HF config.json or GGUF metadata
without torch: how many experts, how many each token uses, how their weights are combined
(the router rule: softmax top-k for Mixtral and Qwen, DeepSeek-V3's grouped sigmoid router for
GLM-4.5 and DeepSeek-V3, gpt-oss's biased router), the shared expert, which layers are sparse,
and the checkpoint's names for the block's tensors. Each family's rule: docs/moe.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# HF architecture -> (the block's module name in a layer, its experts' gate / up / down names)
HF_MOE_NAMES: dict[str, tuple[str, tuple[str, str, str]]] = {
    "MixtralForCausalLM": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen3MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "Qwen2MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "Glm4MoeForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "DeepseekV3ForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "GptOssForCausalLM": ("mlp", ("gate_up_proj", "gate_up_proj", "down_proj")),
    "Qwen3NextForCausalLM": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


# Qwen's MoE architectures with a gated shared expert beside the routed ones.
SHARED_EXPERT_ARCHS = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")


@dataclass(frozen=True)
class MoEConfig:
    """One sparse block's shape, the same in every sparse layer.

    renormalize: the top-k softmax weights are divided by their sum (Mixtral always;
    Qwen `norm_topk_prob`). shared_intermediate_size: 0 without a shared expert; with one, its
    output is scaled by sigmoid(shared_expert_gate(x)) and added (Qwen2-MoE). dense_layers: the
    layers that keep a dense MLP of the model's intermediate_size (Qwen's mlp_only_layers and
    decoder_sparse_step). hf_block, hf_experts: the checkpoint's names of the block and of each
    expert's gate, up and down projections.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    hf_block: str = "mlp"
    hf_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # DeepSeek-V3's router (noaux_tc, GLM-4.5): sigmoid scores, a correction bias for the
    # choice only, grouped top-k, the weights times routed_scaling_factor; the shared expert
    # ungated and named `shared_experts`.
    grouped: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    # gpt-oss: experts with biases and the clamped SwiGLU (alpha, limit): gate clamped above at
    # limit, up to +-limit, out = (up + 1) * gate * sigmoid(alpha * gate); a router with a bias.
    clamped_swiglu: tuple[float, float] | None = None
    # Nemotron-H's MoE blocks (Nemotron 3): ungated squared-ReLU experts and shared expert;
    # the routed experts run in a latent_size space between fc1 / fc2_latent_proj (None: none)
    latent_size: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and "
                f"num_experts={self.num_experts}"
            )
        if self.intermediate_size <= 0:
            raise ValueError(f"the experts' intermediate_size={self.intermediate_size} must be > 0")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers

    def expert_range(self, rank: int, size: int) -> range:
        """The experts rank `rank` of `size` holds under expert parallelism: contiguous, as even
        as can be (the split is E r / T .. E (r + 1) / T)."""
        return range(self.num_experts * rank // size, self.num_experts * (rank + 1) // size)


def moe_from_hf(cfg: dict[str, Any]) -> MoEConfig | None:
    """The MoE shape of an HF config.json (None for a dense architecture)."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in HF_MOE_NAMES:
        return None
    block, experts = HF_MOE_NAMES[arch]
    num_layers = int(cfg["num_hidden_layers"])
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,
            hf_block=block,
            hf_experts=experts,
        )
    if arch == "GptOssForCausalLM":  # top-k of the logits, softmax over those k
        return MoEConfig(
            num_experts=int(cfg["num_local_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,
            hf_block=block,
            hf_experts=experts,
            clamped_swiglu=(
                float(cfg.get("swiglu_alpha", 1.702)),
                float(cfg.get("swiglu_limit", 7.0)),
            ),
        )
    if arch in ("Glm4MoeForCausalLM", "DeepseekV3ForCausalLM"):
        return _deepseek_moe(cfg, block, experts)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    only_mlp = {int(i) for i in cfg.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(num_layers) if i in only_mlp or (i + 1) % step)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    return MoEConfig(
        num_experts=int(cfg.get("num_experts") or cfg["num_local_experts"]),  # v5 saves the latter
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=shared if arch in SHARED_EXPERT_ARCHS else 0,
        dense_layers=dense,
        hf_block=block,
        hf_experts=experts,
    )


def _deepseek_moe(cfg: dict[str, Any], block: str, experts: tuple[str, str, str]) -> MoEConfig:
    """DeepSeek-V3's MoE (and GLM-4.5's, the same): the router is always noaux_tc."""
    num_experts = int(cfg.get("n_routed_experts") or cfg["num_local_experts"])
    width = int(cfg["moe_intermediate_size"])
    num_groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if num_experts % num_groups or not 0 < topk_groups <= num_groups:
        raise ValueError(
            f"n_group={num_groups} must divide n_routed_experts={num_experts} and "
            f"topk_group={topk_groups} be between 1 and n_group"
        )
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=width,
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=width * int(cfg.get("n_shared_experts") or 0),
        dense_layers=tuple(range(int(cfg.get("first_k_dense_replace") or 0))),
        hf_block=block,
        hf_experts=experts,
        grouped=True,
        num_groups=num_groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
    )
