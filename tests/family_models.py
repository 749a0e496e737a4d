"""Tiny random checkpoints of each served non-Llama family, made by transformers from the
family's own config class with each quirk switched on (biases, qk-norm, an explicit head_dim,
a sliding window shorter than the test prompts, soft-capping, partial rotary, longrope), saved
as HF directories. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.factories import EOS_TOKEN_ID, TINY_VOCAB, write_byte_tokenizer

WINDOW = 12  # shorter than every test prompt
# Engine settings per family: Phi-3's longrope takes its short factors when the engine's context
# stays within the original one (transformers: when the sequence does; the tests' all do).
ENGINE_SETTINGS: dict[str, dict[str, Any]] = {"phi3": {"max_model_len": 128}}
# Each family: (transformers config class, its fields beyond COMMON).
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32, "attention_bias": True}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW, "head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 2.0,  # below the tiny model's raw scores: the caps bite
            "final_logit_softcapping": 3.0,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        {
            "sliding_window": 20,
            "max_position_embeddings": 256,
            "original_max_position_embeddings": 128,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0 + i / 4 for i in range(4)],
                "long_factor": [2.0 + i for i in range(4)],
                "original_max_position_embeddings": 128,
            },
        },
    ),
}
# Rope variants (tests/engine/model/test_rope_scaling.py): scalings on a served layout, with an
# original context shorter than the test prompts, so yarn's interpolated pairs and its attention
# factor bite; SmolLM3's layers without rotary.
ROPE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-yarn": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_theta": 10000.0,
            }
        },
    ),
    "qwen3-yarn": (
        "Qwen3Config",
        {
            "head_dim": 32,
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 1e6,
                "beta_fast": 16,
                "truncate": False,
            },
        },
    ),
    "llama-dynamic": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    # SmolLM3's NoPE layers: every second one here (the released models: every fourth).
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
}
COMMON: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "initializer_range": 0.2,
    "rms_norm_eps": 1e-5,
    "bos_token_id": None,
    "eos_token_id": EOS_TOKEN_ID,
    "pad_token_id": None,
}


def make_tiny_family(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model of `family` saved by transformers with the byte tokenizer; biases
    (zero at init) and norms are randomized so they matter."""
    import torch
    import transformers

    class_name, fields = {**FAMILY_CONFIGS, **ROPE_CONFIGS}[family]
    config = getattr(transformers, class_name)(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


def load_hf(directory: Path) -> Any:
    """transformers' model of the directory, float32, its eager attention (the reference for
    soft-capping and sliding windows)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
