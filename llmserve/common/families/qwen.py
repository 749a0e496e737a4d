"""Qwen2 / Qwen2.5 (biases on q, k and v) and Qwen3 (RMSNorm on each head's q and k, an
explicit head_dim); both may window their upper layers (`use_sliding_window`, off in the
released models)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import Family, register


def qwen_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """sliding_window and layer_types: windowed only with use_sliding_window, and then the
    layers from max_window_layers on (unless config.json lists layer_types)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if not window:
        return {"sliding_window": None, "layer_types": ()}
    num_layers = int(cfg["num_hidden_layers"])
    first = int(cfg.get("max_window_layers", num_layers))
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    return {"sliding_window": int(window), "layer_types": tuple(types)}


QWEN2 = register(
    Family(
        name="qwen2",
        hf_architectures=("Qwen2ForCausalLM",),
        hf_model_types=("qwen2",),
        model="llmserve.engine.model.model:LlamaForCausalLM",
        read_hf=lambda cfg: {"qkv_bias": True, **qwen_window(cfg)},
        gguf_architecture="qwen2",
        read_gguf=lambda fields, arch: {"qkv_bias": True},
    )
)

QWEN3 = register(
    Family(
        name="qwen3",
        hf_architectures=("Qwen3ForCausalLM",),
        hf_model_types=("qwen3",),
        model="llmserve.engine.model.families.qwen3:Qwen3ForCausalLM",
        read_hf=qwen_window,
        gguf_architecture="qwen3",
        read_gguf=lambda fields, arch: {},
        gguf_layer_names={"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    )
)
