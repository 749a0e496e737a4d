"""The mixture-of-experts families: Mixtral (Mistral's layers, every MLP a sparse block),
Qwen3-MoE (Qwen3's layers), Qwen2-MoE (Qwen2's, with a shared expert beside the routed
ones) and GLM-4.5 (GQA with partial rotary, optional q/k norms, DeepSeek-V3's MoE). Their MoE
shape is common/moe_config.py's `MoEConfig`, in ModelConfig.moe; the engine's block is
engine/model/moe.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.qwen import QWEN3, qwen_window
from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.moe_config import MoEConfig, moe_from_hf

MOE_REFUSES = {
    "quantization": (
        "the routed experts are not quantized yet (only Linear layers are), so --quantization "
        "would leave most of the weights as they are"
    ),
}


# llama.cpp's tensors of a sparse layer -> the names our blocks read. The routed experts are
# stacked ([E, I, H] for gate and up, [E, H, I] for down): engine/model/families/moe.StackedExperts
# hands out one expert's rows under its per-expert name.
MOE_GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


# GGUF architectures whose top-k weights llama.cpp renormalizes without `expert_weights_norm`.
RENORMALIZING = ("qwen3moe", "qwen3next", "qwen35moe")


def gguf_num_layers(fields: Mapping[str, Any], arch: str) -> int:
    """The decoder's layers: llama.cpp's converter counts the multi-token prediction layers it
    keeps (GLM-4.5's, Qwen3.5's: `nextn_predict_layers`, stored after the others) in
    block_count."""
    nextn = int(fields.get(f"{arch}.nextn_predict_layers") or 0)
    return int(fields[f"{arch}.block_count"]) - nextn


def moe_gguf(fields: Mapping[str, Any], arch: str) -> MoEConfig:
    """The MoE shape from llama.cpp's keys: a layer without a router tensor is dense; without
    `expert_weights_norm`, Qwen3-MoE, Qwen3-Next and Qwen3.5-MoE renormalize and Qwen2-MoE does
    not (llama.cpp's rule for those architectures)."""
    names = fields["tensor_names"]
    num_layers = gguf_num_layers(fields, arch)
    norm = fields.get(f"{arch}.expert_weights_norm")
    return MoEConfig(
        num_experts=int(fields[f"{arch}.expert_count"]),
        top_k=int(fields[f"{arch}.expert_used_count"]),
        intermediate_size=int(fields[f"{arch}.expert_feed_forward_length"]),
        renormalize=bool(norm) if norm is not None else arch in RENORMALIZING,
        shared_intermediate_size=int(fields.get(f"{arch}.expert_shared_feed_forward_length") or 0),
        dense_layers=tuple(
            i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names
        ),
    )


# Mixtral's sparse layers in a GGUF of the Llama architecture.
MIXTRAL_GGUF_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.w1",
    "ffn_up_exps": "block_sparse_moe.experts.w3",
    "ffn_down_exps": "block_sparse_moe.experts.w2",
}


def mixtral_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """What a Llama-architecture GGUF with `expert_count` is: Mixtral (llama.cpp converts it so),
    every layer sparse, the experts feed_forward_length wide, top-k always renormalized."""
    moe = moe_from_hf(
        {
            "architectures": ["MixtralForCausalLM"],
            "num_hidden_layers": fields[f"{arch}.block_count"],
            "num_local_experts": fields[f"{arch}.expert_count"],
            "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
            "intermediate_size": fields[f"{arch}.feed_forward_length"],
        }
    )
    return {"family": "mixtral", "moe": moe}


def _window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mixtral and Qwen3-MoE: every layer windowed when sliding_window is set."""
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


MIXTRAL = register(
    Family(
        name="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        hf_model_types=("mixtral",),
        model="llmserve.engine.model.families.moe:MixtralForCausalLM",
        read_hf=lambda cfg: {"moe": moe_from_hf(dict(cfg)), **_window(cfg)},
        gguf_layer_names=MIXTRAL_GGUF_NAMES,  # its GGUFs are Llama's (mixtral_gguf)
        refuses=MOE_REFUSES,
    )
)

QWEN3_MOE = register(
    Family(
        name="qwen3_moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        hf_model_types=("qwen3_moe",),
        model="llmserve.engine.model.families.moe:Qwen3MoeForCausalLM",
        read_hf=lambda cfg: {"moe": moe_from_hf(dict(cfg)), **_window(cfg)},
        gguf_architecture="qwen3moe",
        read_gguf=lambda fields, arch: {"moe": moe_gguf(fields, arch)},
        gguf_layer_names={**QWEN3.gguf_layer_names, **MOE_GGUF_NAMES},
        refuses=MOE_REFUSES,
    )
)

QWEN2_MOE = register(
    Family(
        name="qwen2_moe",
        hf_architectures=("Qwen2MoeForCausalLM",),
        hf_model_types=("qwen2_moe",),
        model="llmserve.engine.model.families.moe:Qwen2MoeForCausalLM",
        read_hf=lambda cfg: {
            "moe": moe_from_hf(dict(cfg)),
            "qkv_bias": bool(cfg.get("qkv_bias", True)),
            **qwen_window(cfg),
        },
        gguf_architecture="qwen2moe",
        read_gguf=lambda fields, arch: {"moe": moe_gguf(fields, arch), "qkv_bias": True},
        gguf_layer_names=MOE_GGUF_NAMES,
        refuses=MOE_REFUSES,
    )
)


def read_glm4_moe(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GLM-4.5 / 4.6: biases on q, k and v where attention_bias; partial rotary (0.5 unless the
    config or its rope parameters say otherwise); q/k RMSNorm with use_qk_norm."""
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.5
    return {
        "moe": moe_from_hf(dict(cfg)),
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "attention_bias": False,  # o_proj never has one
        "partial_rotary_factor": float(factor),
        "qk_norm": bool(cfg.get("use_qk_norm", False)),
        "num_mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }


SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def deepseek_router_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """DeepSeek-V3's router and experts as config.json names them, from llama.cpp's `expert_*`
    keys (deepseek2 and glm4moe files write them alike); the group keys are 1 where absent."""
    return {
        "n_routed_experts": fields[f"{arch}.expert_count"],
        "num_experts_per_tok": fields[f"{arch}.expert_used_count"],
        "moe_intermediate_size": fields[f"{arch}.expert_feed_forward_length"],
        "n_shared_experts": fields.get(f"{arch}.expert_shared_count") or 0,
        "first_k_dense_replace": fields.get(f"{arch}.leading_dense_block_count") or 0,
        "norm_topk_prob": bool(fields.get(f"{arch}.expert_weights_norm")),
        "routed_scaling_factor": fields.get(f"{arch}.expert_weights_scale") or 1.0,
        "n_group": fields.get(f"{arch}.expert_group_count") or 1,
        "topk_group": fields.get(f"{arch}.expert_group_used_count") or 1,
    }


def read_glm4_moe_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `glm4moe` GGUF (convert_hf_to_gguf.py's Glm4MoeModel) as read_glm4_moe reads
    config.json: block_count counts the MTP layers (`nextn_predict_layers`, not served), the
    first `leading_dense_block_count` layers dense, DeepSeek-V3's router from the expert_* keys
    (groups as `expert_group_count` / `expert_group_used_count`, 1 without them), the rotary
    dims as `rope.dimension_count`; q/k/v biases and q/k norms where their tensors are."""
    gating = fields.get(f"{arch}.expert_gating_func")
    if gating is not None and gating != SIGMOID_GATING:
        raise ModelSourceError(
            f"GGUF {arch}.expert_gating_func={gating}: only the sigmoid router "
            f"({SIGMOID_GATING}) is served"
        )
    names, num_layers = fields["tensor_names"], gguf_num_layers(fields, arch)
    cfg = {
        "architectures": ["Glm4MoeForCausalLM"],
        "num_hidden_layers": num_layers,
        **deepseek_router_gguf(fields, arch),
    }
    heads = int(fields[f"{arch}.attention.head_count"])
    head_dim = int(
        fields.get(f"{arch}.attention.key_length")
        or int(fields[f"{arch}.embedding_length"]) // heads
    )
    return {
        "num_layers": num_layers,
        "num_mtp_layers": int(fields.get(f"{arch}.nextn_predict_layers") or 0),
        "moe": moe_from_hf(cfg),
        "head_dim": head_dim,
        "qkv_bias": "blk.0.attn_q.bias" in names,
        "attention_bias": False,
        "partial_rotary_factor": int(fields[f"{arch}.rope.dimension_count"]) / head_dim,
        "qk_norm": "blk.0.attn_q_norm.weight" in names,
    }


# llama.cpp's glm4moe tensors -> ours: Qwen3's q/k norms, the stacked experts, DeepSeek's shared
# experts and correction bias (`exp_probs_b.bias`: engine/model/families/moe.StackedExperts
# reads it as HF's `e_score_correction_bias`), the post-attention norm.
GLM4_MOE_GGUF_NAMES = {
    **QWEN3.gguf_layer_names,
    **MOE_GGUF_NAMES,
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",
    "post_attention_norm": "post_attention_layernorm",
}


GLM4_MOE = register(
    Family(
        name="glm4_moe",
        hf_architectures=("Glm4MoeForCausalLM",),
        hf_model_types=("glm4_moe",),
        model="llmserve.engine.model.families.moe:Glm4MoeForCausalLM",
        read_hf=read_glm4_moe,
        gguf_architecture="glm4moe",
        read_gguf=read_glm4_moe_gguf,
        gguf_layer_names=GLM4_MOE_GGUF_NAMES,
        refuses=MOE_REFUSES,
    )
)
