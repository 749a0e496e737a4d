"""Qwen3.5 (Qwen3_5ForCausalLM dense, Qwen3_5MoeForCausalLM, and the text model of their
ForConditionalGeneration checkpoints): Qwen3-Next's layers (common/families/qwen3_next.py) with
the DeltaNet's projections stored flat (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`
instead of Qwen3-Next's per-key-head `in_proj_qkvz` / `in_proj_ba`), a dense MLP in every layer
(Qwen3.5) or a sparse block with a gated shared expert in every layer (Qwen3.5-MoE, top-k
always renormalised), and multimodal rope (`mrope_section`), which for text (the three position
ids equal) is the plain partial rotary. A released checkpoint is the multimodal class: its
config.json nests the text model's under `text_config` (common/model_config.py reads it) and
its weights under `model.language_model.`; the vision tower's are not read, and the gateway
takes text content parts only. docs/models.md#qwen35.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.qwen3_next import (
    QWEN3_NEXT,
    QWEN3_NEXT_GGUF_NAMES,
    read_qwen3_next,
    read_qwen3_next_gguf,
)
from llmserve.common.families.registry import Family, register

QWEN3_5_DENSE = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


def read_qwen3_5(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """read_qwen3_next's fields, the MoE (if any) read as Qwen3-Next's block in every layer
    with the top-k renormalised (Qwen3.5-MoE's config has no norm_topk_prob, mlp_only_layers
    or decoder_sparse_step: transformers renormalises always)."""
    moe = int(cfg.get("num_experts") or 0) > 0
    as_next = {
        **cfg,
        "architectures": ["Qwen3NextForCausalLM"],
        "num_experts": int(cfg.get("num_experts") or 0) if moe else 0,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "decoder_sparse_step": 1,
    }
    return read_qwen3_next(as_next)


# llama.cpp's qwen35 / qwen35moe tensors: Qwen3-Next's names, in_proj_b / in_proj_a stored
# apart (ssm_beta / ssm_alpha); engine/model/families/qwen3_next_gguf.py undoes the rest.
QWEN3_5_GGUF_NAMES = {
    **QWEN3_NEXT_GGUF_NAMES,
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}


QWEN3_5 = register(
    Family(
        name="qwen3_5",
        hf_architectures=QWEN3_5_DENSE + QWEN3_5_MOE,
        hf_model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        model="llmserve.engine.model.families.qwen3_next:Qwen3_5ForCausalLM",
        read_hf=read_qwen3_5,
        gguf_architecture="qwen35",
        gguf_aliases=("qwen35moe",),
        read_gguf=read_qwen3_next_gguf,
        gguf_layer_names=QWEN3_5_GGUF_NAMES,
        refuses={
            **QWEN3_NEXT.refuses,
            "quantization": (
                "Qwen3.5-MoE's routed experts are not quantized (only Linear layers are) and the "
                "DeltaNet layers' projections, loaded in parts, are not checked quantized"
            ),
        },
    )
)
