"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by (1 + w), embeddings times sqrt(hidden_size),
a gelu-tanh gated MLP, norms before and after attention and MLP, the softmax scale
query_pre_attn_scalar ** -0.5, layers alternating between a sliding window and the whole
context; Gemma 2 soft-caps attention scores and the final logits, Gemma 3 normalizes each head's
q and k and rotates its sliding layers with their own base (rope_local_base_freq)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.families.rope import rope_from_hf


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


def _gguf_layer_types(fields: Mapping[str, Any], arch: str, pattern: int) -> tuple[str, ...]:
    """Per layer from {arch}.attention.sliding_window_pattern: a list of bools (True: sliding)
    or n (layer i sliding unless i % n == n - 1); without it, llama.cpp's n for the family."""
    num_layers = int(fields[f"{arch}.block_count"])
    value = fields.get(f"{arch}.attention.sliding_window_pattern", pattern)
    sliding = (
        [bool(v) for v in value]
        if isinstance(value, list)
        else [i % int(value) < int(value) - 1 for i in range(num_layers)]
    )
    return tuple("sliding_attention" if s else "full_attention" for s in sliding)


def _gemma_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A GGUF has no query_pre_attn_scalar: llama.cpp scales by head_dim ** -0.5, except for the
    27B models (46 and 62 layers), whose scalar is hidden_size / num_heads; so do we."""
    hidden, heads = (
        int(fields[f"{arch}.embedding_length"]),
        int(fields[f"{arch}.attention.head_count"]),
    )
    layers = int(fields[f"{arch}.block_count"])
    head_dim = int(fields.get(f"{arch}.attention.key_length") or hidden // heads)
    scalar = hidden / heads if (arch, layers) in (("gemma2", 46), ("gemma3", 62)) else head_dim
    window = fields.get(f"{arch}.attention.sliding_window")
    caps = [fields.get(f"{arch}.{k}_logit_softcapping") for k in ("attn", "final")]
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "embed_scale": float(hidden) ** 0.5,
        "attention_scale": float(scalar) ** -0.5,
        "sliding_window": int(window) if window else None,
        "layer_types": _gguf_layer_types(fields, arch, 2 if arch == "gemma2" else 6),
        "attn_logit_softcap": float(caps[0]) if caps[0] else None,
        "final_logit_softcap": float(caps[1]) if caps[1] else None,
    }


def _gemma3_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    local = float(fields.get(f"{arch}.rope.freq_base_swa", 10000.0))
    return {**_gemma_gguf(fields, arch), "rope_local_theta": local}


GEMMA_GGUF_NAMES = {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

GEMMA2 = register(
    Family(
        name="gemma2",
        hf_architectures=("Gemma2ForCausalLM",),
        hf_model_types=("gemma2",),
        model="llmserve.engine.model.families.gemma:Gemma2ForCausalLM",
        read_hf=_gemma2_hf,
        gguf_architecture="gemma2",
        read_gguf=_gemma_gguf,
        gguf_layer_names=GEMMA_GGUF_NAMES,
        gguf_norms_plus_one=True,
    )
)

GEMMA3 = register(
    Family(
        name="gemma3",
        hf_architectures=("Gemma3ForCausalLM",),
        hf_model_types=("gemma3_text",),
        model="llmserve.engine.model.families.gemma:Gemma3ForCausalLM",
        read_hf=_gemma3_hf,
        gguf_architecture="gemma3",
        read_gguf=_gemma3_gguf,
        gguf_layer_names=GEMMA_GGUF_NAMES,
        gguf_norms_plus_one=True,
    )
)
