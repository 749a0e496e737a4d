"""Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba-2 layers and GQA attention layers by
`layer_types` ("mamba" / "attention"; transformers 5 also writes "linear_attention" /
"full_attention"), rotary only where position_embedding_type is "rope", an MoE with an
ungated shared MLP in every layer (or the shared MLP alone: num_local_experts 0), and
Granite's multipliers. Each Mamba layer keeps, per request, conv [conv_dim, d_conv - 1] and
SSM [heads, head_dim, d_state] (common/mamba2_config.py) in the request's state slot.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.mamba2_config import mamba2_from_granite
from llmserve.common.moe_config import MoEConfig

# layer_types spellings -> ours ("mamba": a state layer, "full_attention": a KV layer)
LAYER_TYPES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
}


def granite_layer_types(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """Each layer's kind, named by the field when config.json has one we do not know."""
    num_layers = int(cfg["num_hidden_layers"])
    given = cfg.get("layer_types") or cfg.get("layers_block_type") or ["mamba"] * num_layers
    unknown = sorted({t for t in given if t not in LAYER_TYPES})
    if unknown:
        raise ModelSourceError(
            f"layer_types {unknown} are not Granite 4.0-H layers (mamba or attention)"
        )
    return tuple(LAYER_TYPES[t] for t in given)


def read_granite_hybrid(cfg: Mapping[str, Any]) -> dict[str, Any]:
    num_experts = int(cfg.get("num_local_experts") or 0)
    moe = None
    if num_experts:
        moe = MoEConfig(
            num_experts=num_experts,
            top_k=int(cfg.get("num_experts_per_tok") or 2),
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,  # softmax over the top-k logits
            hf_block="block_sparse_moe",
            hf_experts=("input_linear", "input_linear", "output_linear"),
        )
    rope = cfg.get("position_embedding_type") == "rope"
    mamba2 = mamba2_from_granite(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    return {
        # the shared MLP: the dense MLP every layer has beside its experts
        "intermediate_size": int(cfg.get("shared_intermediate_size") or 1024),
        "layer_types": granite_layer_types(cfg),
        "nope_layers": () if rope else tuple(range(num_layers)),
        "attention_scale": float(cfg.get("attention_multiplier") or 1.0),
        "embed_scale": float(cfg.get("embedding_multiplier") or 1.0),
        "residual_multiplier": float(cfg.get("residual_multiplier") or 1.0),
        "logits_scaling": float(cfg.get("logits_scaling") or 1.0),
        "moe": moe,
        "mamba2": mamba2,
        "state_layout": mamba2.layout(),
    }


GRANITE_HYBRID = register(
    Family(
        name="granite_hybrid",
        hf_architectures=("GraniteMoeHybridForCausalLM",),
        hf_model_types=("granitemoehybrid",),
        model="llmserve.engine.model.families.granite_hybrid:GraniteMoeHybridForCausalLM",
        read_hf=read_granite_hybrid,
        refuses={
            "speculative_decoding": "a rejected draft token would need the recurrent state "
            "rolled back",
            "quantization": "the Mamba-2 projections are not wired to the quantized linears",
            "lora": "adapters for the Mamba-2 and expert projections are not loaded",
        },
    )
)
