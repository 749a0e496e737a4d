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
from llmserve.common.mamba2_config import Mamba2Config, json_float, mamba2_gguf_shape
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


def _gguf_block_types(fields: Mapping[str, Any], arch: str) -> list[str]:
    """Each block's kind as llama.cpp tells them apart: KV heads (attention), a feed-forward
    width (the MLP, or with MoE blocks the MoE), else a Mamba-2 layer; the trailing
    `nextn_predict_layers` blocks (multi-token prediction) left out, as unread."""
    num_layers = int(fields[f"{arch}.block_count"])
    kv, ff = fields[f"{arch}.attention.head_count_kv"], fields[f"{arch}.feed_forward_length"]
    kv = kv if isinstance(kv, list) else [kv] * num_layers
    ff = ff if isinstance(ff, list) else [ff] * num_layers
    mlp = "moe" if arch == "nemotron_h_moe" else "mlp"
    kinds = ["attention" if k else mlp if f else "mamba" for k, f in zip(kv, ff, strict=True)]
    # the converter appends the multi-token-prediction block(s) after the model's own
    return kinds[: num_layers - int(fields.get(f"{arch}.nextn_predict_layers") or 0)]


def _gguf_moe(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The MoE keys (NemotronHModel's set_gguf_parameters) as config.json's fields; the
    converter writes expert_group_count but not how many groups are kept, so a file of more
    than one group without expert_group_used_count is refused."""
    groups = int(fields.get(f"{arch}.expert_group_count") or 1)
    used = fields.get(f"{arch}.expert_group_used_count")
    if groups > 1 and used is None:
        raise ModelSourceError(
            f"GGUF {arch}.expert_group_count={groups} without {arch}.expert_group_used_count: "
            "the number of expert groups each token keeps (topk_group) is not recorded"
        )
    return {
        "n_routed_experts": fields[f"{arch}.expert_count"],
        "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
        "moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"],
        "moe_shared_expert_intermediate_size": fields[f"{arch}.expert_shared_feed_forward_length"],
        "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm", True)),
        "routed_scaling_factor": fields.get(f"{arch}.expert_weights_scale"),
        "n_group": groups,
        "topk_group": 1 if used is None else int(used),
        "moe_latent_size": fields.get(f"{arch}.moe_latent_size"),
    }


def read_nemotron_h_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `nemotron_h` or `nemotron_h_moe` GGUF (convert_hf_to_gguf.py's NemotronHModel) as
    read_nemotron_h reads config.json: the blocks from the per-layer head_count_kv and
    feed_forward_length, the mixer from `ssm.*`, the MoE from the expert keys."""
    try:
        shape = mamba2_gguf_shape(fields, arch)
    except ValueError as e:
        raise ModelSourceError(f"GGUF: {e}") from None
    cfg: dict[str, Any] = {
        "layers_block_type": _gguf_block_types(fields, arch),
        "layer_norm_epsilon": fields.get(f"{arch}.attention.layer_norm_rms_epsilon"),
        "mamba_num_heads": shape["heads"],
        "mamba_head_dim": shape["head_dim"],
        "n_groups": shape["groups"],
        "ssm_state_size": shape["state_size"],
        "conv_kernel": shape["conv_kernel"],
        "use_conv_bias": shape["conv_bias"],
        "use_bias": shape["proj_bias"],
    }
    if arch == "nemotron_h_moe":
        cfg.update(_gguf_moe(fields, arch))
    return read_nemotron_h(cfg)


# llama.cpp's names of a Nemotron-H block's tensors (under `model.layers.N.`: the engine's
# mamba2_gguf moves them under `backbone.`, splits the stacked experts and reads ssm_a, ssm_d
# and ssm_dt.bias).
NEMOTRON_H_GGUF_NAMES = {
    "attn_norm": "norm",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ssm_in": "mixer.in_proj",
    "ssm_conv1d": "mixer.conv1d",
    "ssm_norm": "mixer.norm",
    "ssm_out": "mixer.out_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    "ffn_gate_inp": "mixer.gate",
    "exp_probs_b": "mixer.gate.e_score_correction",
    "ffn_up_exps": "mixer.experts.up_proj",
    "ffn_down_exps": "mixer.experts.down_proj",
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
    "ffn_latent_down": "mixer.fc1_latent_proj",
    "ffn_latent_up": "mixer.fc2_latent_proj",
}


NEMOTRON_H = register(
    Family(
        name="nemotron_h",
        hf_architectures=("NemotronHForCausalLM",),
        hf_model_types=("nemotron_h",),
        model="llmserve.engine.model.families.nemotron_h:NemotronHForCausalLM",
        read_hf=read_nemotron_h,
        gguf_architecture="nemotron_h",
        gguf_aliases=("nemotron_h_moe",),
        read_gguf=read_nemotron_h_gguf,
        gguf_layer_names=NEMOTRON_H_GGUF_NAMES,
        refuses=GRANITE_HYBRID.refuses,
    )
)
