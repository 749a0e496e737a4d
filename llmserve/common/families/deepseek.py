"""DeepSeek-V3 / R1 and Kimi K2 (DeepseekV3ForCausalLM): multi-head latent attention
(common/mla_config.py) and DeepSeek-V3's MoE (the router GLM-4.5 shares: common/moe_config.py),
the first first_k_dense_replace layers dense."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.moe import MOE_REFUSES
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


DEEPSEEK_V3 = register(
    Family(
        name="deepseek_v3",
        hf_architectures=("DeepseekV3ForCausalLM",),
        hf_model_types=("deepseek_v3", "kimi_k2"),
        model="llmserve.engine.model.families.deepseek:DeepseekV3ForCausalLM",
        read_hf=read_deepseek_v3,
        refuses={
            **MOE_REFUSES,
            "lora": (
                "multi-head latent attention's projections (q_a / q_b, kv_a / kv_b) take no "
                "adapters yet, and its experts none: an adapter would be left unapplied"
            ),
        },
    )
)
