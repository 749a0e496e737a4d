"""Llama and Mistral: the Llama layout (engine/model/model.py), Mistral with its sliding window."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import Family, register

LLAMA_MODEL = "llmserve.engine.model.model:LlamaForCausalLM"


def _llama_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """llama.cpp converts Mistral as the Llama architecture: its window, where it is written."""
    window = fields.get(f"{arch}.attention.sliding_window")
    read = {
        "attention_bias": "blk.0.attn_q.bias" in fields["tensor_names"],
        "sliding_window": int(window) if window else None,
    }
    if fields.get(f"{arch}.expert_count"):  # and Mixtral as Llama with experts
        from llmserve.common.families.moe import mixtral_gguf

        read.update(mixtral_gguf(fields, arch))
    return read


def _mistral_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


LLAMA = register(
    Family(
        name="llama",
        hf_architectures=("LlamaForCausalLM",),
        hf_model_types=("llama",),
        model=LLAMA_MODEL,
        read_hf=lambda cfg: {},
        gguf_architecture="llama",
        read_gguf=_llama_gguf,
    )
)

MISTRAL = register(
    Family(
        name="mistral",
        hf_architectures=("MistralForCausalLM",),
        hf_model_types=("mistral",),
        model=LLAMA_MODEL,
        read_hf=_mistral_hf,
    )
)
