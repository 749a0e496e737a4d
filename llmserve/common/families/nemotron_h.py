"""Nemotron-H (NemotronHForCausalLM): a stack of single-mixer blocks, each `norm -> mixer ->
residual add`, the mixer a Mamba-2 layer, GQA attention without rotary, or a squared-ReLU MLP,
by `hybrid_override_pattern` ("M", "*", "-") or transformers 5's `layers_block_type`
("linear_attention", "full_attention", "mlp", "moe"). Its MoE blocks ("E", Nemotron 3):
DeepSeek-V3's grouped sigmoid router with the score-correction bias (n_group, topk_group,
routed_scaling_factor, norm_topk_prob), ungated squared-ReLU experts, optionally in a latent
space (moe_latent_size), and an ungated shared expert. The Mamba layers keep their state in
the scheduler's state slots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.granite_hybrid import GRANITE_HYBRID
from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.mamba2_config import Mamba2Config, json_float
from llmserve.common.moe_config import MoEConfig

PATTERN = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}
BLOCK_TYPES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
    "mlp": "mlp",
    "moe": "moe",
}


def nemotron_layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    pattern = cfg.get("hybrid_override_pattern")
    given = cfg.get("layers_block_type") or cfg.get("layer_types")
    if given is None and pattern is not None:
        given = [PATTERN.get(c, c) for c in pattern]
    if not given:
        raise ModelSourceError("Nemotron-H config.json gives neither layers_block_type nor "
                               "hybrid_override_pattern")  # fmt: skip
    unknown = sorted({t for t in given if t not in BLOCK_TYPES})
    if unknown:
        raise ModelSourceError(f"Nemotron-H block types {unknown} are not known")
    return tuple(BLOCK_TYPES[t] for t in given)


def nemotron_moe(cfg: Mapping[str, Any]) -> MoEConfig:
    """The MoE blocks' shape (NemotronHConfig's defaults where config.json leaves one out)."""
    act = str(cfg.get("mlp_hidden_act") or "relu2")
    if act != "relu2":
        raise ModelSourceError(f"Nemotron-H mlp_hidden_act={act!r} is not served (relu2 only)")
    latent = cfg.get("moe_latent_size")
    try:
        return MoEConfig(
            num_experts=int(cfg.get("n_routed_experts") or 8),
            top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate_size=int(cfg.get("moe_intermediate_size") or 7688),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            shared_intermediate_size=int(cfg.get("moe_shared_expert_intermediate_size") or 7688),
            hf_block="mixer",
            hf_experts=("up_proj", "up_proj", "down_proj"),
            grouped=True,
            num_groups=int(cfg.get("n_group") or 1),
            topk_groups=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            latent_size=None if latent is None else int(latent),
        )
    except ValueError as e:
        raise ModelSourceError(f"Nemotron-H config.json: {e}") from None


def read_nemotron_h(cfg: Mapping[str, Any]) -> dict[str, Any]:
    types = nemotron_layer_types(cfg)
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    mamba2 = Mamba2Config(
        num_heads=int(cfg.get("mamba_num_heads") or 128),
        head_dim=int(cfg.get("mamba_head_dim") or 64),
        num_groups=int(cfg.get("n_groups") or 8),
        state_size=int(cfg.get("ssm_state_size") or 128),
        conv_kernel=int(cfg.get("conv_kernel") or 4),
        chunk_size=int(cfg.get("chunk_size") or 128),
        conv_bias=bool(cfg.get("use_conv_bias", True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        time_step_limit=(json_float(limit[0]), json_float(limit[1])),
    )
    return {
        "num_layers": len(types),
        "layer_types": types,
        "nope_layers": tuple(range(len(types))),
        "rms_norm_eps": float(cfg.get("layer_norm_epsilon") or 1e-5),
        "hidden_act": str(cfg.get("mlp_hidden_act") or "relu2"),
        "mamba2": mamba2,
        "state_layout": mamba2.layout(),
        "moe": nemotron_moe(cfg) if "moe" in types else None,
    }


NEMOTRON_H = register(
    Family(
        name="nemotron_h",
        hf_architectures=("NemotronHForCausalLM",),
        hf_model_types=("nemotron_h",),
        model="llmserve.engine.model.families.nemotron_h:NemotronHForCausalLM",
        read_hf=read_nemotron_h,
        refuses=GRANITE_HYBRID.refuses,
    )
)
