"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by (1 + w), embeddings times sqrt(hidden_size),
a gelu-tanh gated MLP, norms before and after attention and MLP, the softmax scale
query_pre_attn_scalar ** -0.5, layers alternating between a sliding window and the whole
context; Gemma 2 soft-caps attention scores and the final logits, Gemma 3 normalizes each head's
q and k and rotates its sliding layers with their own base (rope_local_base_freq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.families.registry import Family, ModelSourceError, register
from common.families.rope import rope_from_hf


def _layer_types(cfg: Mapping[str, Any], pattern: int) -> tuple[str, ...]:
    """config.json's layer_types, or the older configs' rule: every `pattern`-th layer full."""
    if cfg.get("layer_types"):
        return tuple(cfg["layer_types"])
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(int(cfg["num_hidden_layers"]))
    )


def _gemma_common(cfg: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):  # "gelu" in Gemma configs means the tanh form
        raise ModelSourceError(f"hidden_activation={act!r}: Gemma's is gelu_pytorch_tanh")
    window = cfg.get("sliding_window")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
        "embed_scale": float(cfg["hidden_size"]) ** 0.5,
        "attention_scale": float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        "sliding_window": int(window) if window else None,
        "layer_types": _layer_types(cfg, pattern),
    }


def _gemma2_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    attn_cap, final_cap = cfg.get("attn_logit_softcapping"), cfg.get("final_logit_softcapping")
    return {
        **_gemma_common(cfg, 2),
        "attn_logit_softcap": float(attn_cap) if attn_cap else None,
        "final_logit_softcap": float(final_cap) if final_cap else None,
    }


def _gemma3_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers v5: per layer type
        theta, scaling = rope_from_hf(params["full_attention"], cfg)
        local_theta, local_scaling = rope_from_hf(params["sliding_attention"], cfg)
        if local_scaling is not None:
            raise ModelSourceError("Gemma 3: scaled rope on sliding layers is not supported")
    else:
        theta, scaling = rope_from_hf(None, cfg)
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    return {
        **_gemma2_hf(cfg),
        **_gemma_common(cfg, int(cfg.get("sliding_window_pattern") or 6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_theta": local_theta,
    }


GEMMA2 = register(
    Family(
        name="gemma2",
        hf_architectures=("Gemma2ForCausalLM",),
        hf_model_types=("gemma2",),
        model="engine.families.gemma:Gemma2ForCausalLM",
        read_hf=_gemma2_hf,
    )
)

GEMMA3 = register(
    Family(
        name="gemma3",
        hf_architectures=("Gemma3ForCausalLM",),
        hf_model_types=("gemma3_text",),
        model="engine.families.gemma:Gemma3ForCausalLM",
        read_hf=_gemma3_hf,
    )
)
