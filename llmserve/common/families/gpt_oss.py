"""gpt-oss (GptOssForCausalLM): GQA with q/k/v/o biases and attention sinks (a learned logit
per head in each softmax's denominator), layers alternating a 128-token sliding window and full
attention (`layer_types`), yarn rope, and a mixture of experts with a biased router and biased
experts under the clamped SwiGLU (common/moe_config.py). Float experts only: the released
MXFP4 checkpoints are the checkpoint-format loader's (engine/model/checkpoint_formats.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.moe import MOE_REFUSES
from llmserve.common.families.registry import Family, register
from llmserve.common.families.rope import rope_from_hf
from llmserve.common.moe_config import moe_from_hf

# GptOssConfig's defaults where a config.json leaves a field out
DEFAULT_ROPE = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}  # fmt: skip


def read_gpt_oss(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """What differs from Llama's reading, with GptOssConfig's defaults: head_dim 64, a window
    of 128 on every other layer from the first, yarn (factor 32 over 4096, untruncated)."""
    num_layers = int(cfg["num_hidden_layers"])
    alternating = ["sliding_attention", "full_attention"] * num_layers
    fields: dict[str, Any] = {
        "moe": moe_from_hf(dict(cfg)),
        "head_dim": int(cfg.get("head_dim") or 64),
        "attention_bias": bool(cfg.get("attention_bias", True)),
        "attention_sinks": True,
        "sliding_window": int(cfg.get("sliding_window") or 128),
        "layer_types": tuple(cfg.get("layer_types") or alternating[:num_layers]),
    }
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        theta = cfg.get("rope_theta", 150000.0)
        fields["rope_theta"], fields["rope_scaling"] = rope_from_hf(
            {**DEFAULT_ROPE, "rope_theta": theta}, cfg
        )
    return fields


# llama.cpp's gpt-oss tensors -> ours; the experts' split gate / up and transposed down come back
# to transformers' fused layout in the engine (engine/model/families/gpt_oss.GGUFExperts).
GPT_OSS_GGUF_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# What llama.cpp's gpt-oss graph fixes rather than reads: the SwiGLU's limit (alpha 1.702 too),
# yarn without truncation, windows on the even layers.
GGUF_SWIGLU_LIMIT = 7.0


def read_gpt_oss_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `gpt-oss` GGUF as read_gpt_oss reads config.json; its rope (freq_base, yarn factor,
    original context, betas) is the common reader's, untruncated as gpt-oss's config says."""
    cfg = {
        "architectures": ["GptOssForCausalLM"],
        "num_hidden_layers": fields[f"{arch}.block_count"],
        "num_local_experts": fields[f"{arch}.expert_count"],
        "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
        "intermediate_size": fields[f"{arch}.expert_feed_forward_length"],
        "swiglu_limit": GGUF_SWIGLU_LIMIT,
        "head_dim": fields.get(f"{arch}.attention.key_length"),
        "sliding_window": fields.get(f"{arch}.attention.sliding_window"),
        "rope_scaling": {"rope_type": "none"},  # read below, not GptOssConfig's default
    }
    read = read_gpt_oss(cfg)
    if fields.get(f"{arch}.rope.scaling.type") == "yarn":
        scaling = {
            "rope_type": "yarn",
            "factor": float(fields[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(
                fields[f"{arch}.rope.scaling.original_context_length"]
            ),
            "truncate": False,
        }
        for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if fields.get(f"{arch}.rope.scaling.{key}") is not None:
                scaling[ours] = float(fields[f"{arch}.rope.scaling.{key}"])
        read["rope_scaling"] = scaling
    return read


GPT_OSS = register(
    Family(
        name="gpt_oss",
        hf_architectures=("GptOssForCausalLM",),
        hf_model_types=("gpt_oss",),
        model="llmserve.engine.model.families.gpt_oss:GptOssForCausalLM",
        read_hf=read_gpt_oss,
        gguf_architecture="gpt-oss",
        read_gguf=read_gpt_oss_gguf,
        gguf_layer_names=GPT_OSS_GGUF_NAMES,
        refuses={
            **MOE_REFUSES,
            "lora": "its experts (every MLP) take no adapters yet: one would be left unapplied",
        },
    )
)
