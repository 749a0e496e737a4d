"""DeepSeek-V3 / R1 and Kimi K2 (DeepseekV3ForCausalLM): multi-head latent attention
(common/mla_config.py) and DeepSeek-V3's MoE (the router GLM-4.5 shares: common/moe_config.py),
the first first_k_dense_replace layers dense."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.moe import (
    MOE_GGUF_NAMES,
    MOE_REFUSES,
    SIGMOID_GATING,
    deepseek_router_gguf,
)
from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.families.rope import rope_from_hf
from llmserve.common.mla_config import mla_from_hf, mla_softmax_scale
from llmserve.common.moe_config import moe_from_hf


def read_deepseek_v3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """head_dim is the rotary part's (as transformers sets it): the rotary embedding turns
    qk_rope_head_dim values per head; the softmax scale is the whole q/k head's, with yarn's
    mscale_all_dim folded in."""
    for key, ours in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
        if cfg.get(key, ours) != ours:
            raise ModelSourceError(
                f"DeepseekV3ForCausalLM: {key}={cfg[key]!r} is not served (only {ours!r})"
            )
    mla = mla_from_hf(cfg)
    _, scaling = rope_from_hf(cfg.get("rope_parameters"), cfg)
    return {
        "mla": mla,
        "moe": moe_from_hf(dict(cfg)),
        "head_dim": mla.qk_rope_head_dim,
        "attention_scale": mla_softmax_scale(mla, scaling),
        "num_mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }


# llama.cpp's deepseek2 tensors -> ours. Its converter splits kv_b_proj per head into attn_k_b
# (W_UK transposed, [heads, kv_lora_rank, nope]) and attn_v_b ([heads, v, kv_lora_rank]); older
# files keep attn_kv_b. The engine's DeepseekV3ForCausalLM.checkpoint_view joins the halves and
# reads the correction bias, `exp_probs_b.bias`, under HF's name.
DEEPSEEK2_GGUF_NAMES = {
    **MOE_GGUF_NAMES,
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj",
    "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}


def read_deepseek2_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `deepseek2` GGUF (llama.cpp writes DeepSeek-V2 / V3 / R1 and Kimi K2 so) as the
    config.json read_deepseek_v3 takes: the MLA widths from key/value_length_mla (or, in older
    files, key/value_length), the router's keys; V2's softmax router is refused by name, as
    from config.json. llama.cpp rotates DeepSeek's interleaved pairs: rope_interleave."""
    gating = fields.get(f"{arch}.expert_gating_func")
    if gating != SIGMOID_GATING:
        raise ModelSourceError(
            f"GGUF {arch}.expert_gating_func={gating}: only DeepSeek-V3's sigmoid router "
            f"({SIGMOID_GATING}) is served (V2's softmax router is not)"
        )
    rope = int(fields[f"{arch}.rope.dimension_count"])
    mla_keys = f"{arch}.attention.key_length_mla" in fields
    key = int(fields[f"{arch}.attention.key_length" + ("_mla" if mla_keys else "")])
    heads = int(fields[f"{arch}.attention.head_count"])
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_hidden_layers": fields[f"{arch}.block_count"],
        "kv_lora_rank": fields[f"{arch}.attention.kv_lora_rank"],
        "q_lora_rank": fields.get(f"{arch}.attention.q_lora_rank"),
        "qk_nope_head_dim": key - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": fields[f"{arch}.attention.value_length" + ("_mla" if mla_keys else "")],
        "rope_interleave": True,
        **deepseek_router_gguf(fields, arch),
    }
    mla = mla_from_hf(cfg)
    log_mul = fields.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    yarn = {
        "factor": fields.get(f"{arch}.rope.scaling.factor"),
        "mscale_all_dim": None if log_mul is None else float(log_mul) / 0.1,
    }
    return {
        "mla": mla,
        "moe": moe_from_hf(cfg),
        "head_dim": rope,
        "num_kv_heads": heads,  # llama.cpp writes 1 (MQA over the latent); transformers, heads
        "attention_scale": mla_softmax_scale(mla, yarn),
    }


DEEPSEEK_V3 = register(
    Family(
        name="deepseek_v3",
        hf_architectures=("DeepseekV3ForCausalLM",),
        hf_model_types=("deepseek_v3", "kimi_k2"),
        model="llmserve.engine.model.families.deepseek:DeepseekV3ForCausalLM",
        read_hf=read_deepseek_v3,
        gguf_architecture="deepseek2",
        read_gguf=read_deepseek2_gguf,
        gguf_layer_names=DEEPSEEK2_GGUF_NAMES,
        refuses={
            **MOE_REFUSES,
            "lora": (
                "multi-head latent attention's projections (q_a / q_b, kv_a / kv_b) take no "
                "adapters yet, and its experts none: an adapter would be left unapplied"
            ),
        },
    )
)
