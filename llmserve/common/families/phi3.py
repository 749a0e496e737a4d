"""Phi-3 and Phi-4 (HF `Phi3ForCausalLM`): q/k/v and gate/up stored fused (split at load), a
rotary over part of each head (partial_rotary_factor), longrope scaling where the config names
it, a sliding window where it sets one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import Family, register


def _phi3_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    window = cfg.get("sliding_window")
    return {
        "partial_rotary_factor": float(factor),
        "sliding_window": int(window) if window else None,
    }


def _phi3_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """head_dim is hidden / heads ({arch}.rope.dimension_count is the rotated part); longrope's
    factors are the rope_factors_short / _long tensors."""
    hidden, heads = (
        int(fields[f"{arch}.embedding_length"]),
        int(fields[f"{arch}.attention.head_count"]),
    )
    head_dim = hidden // heads
    rotary = int(fields.get(f"{arch}.rope.dimension_count", head_dim))
    window = fields.get(f"{arch}.attention.sliding_window")
    out: dict[str, Any] = {
        "head_dim": head_dim,
        "partial_rotary_factor": rotary / head_dim,
        "sliding_window": int(window) if window else None,
    }
    if "rope_factors_short.weight" in fields["tensor_names"]:
        gguf_file = fields["gguf_file"]
        factors = {
            t.name.split(".")[0].removeprefix("rope_factors_"): gguf_file.tensor_array(t).tolist()
            for t in gguf_file.tensors
            if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")
        }
        original = fields.get(f"{arch}.rope.scaling.original_context_length")
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": factors["short"],
            "long_factor": factors["long"],
            "original_max_position_embeddings": int(original or fields[f"{arch}.context_length"]),
            "attention_factor": fields.get(f"{arch}.rope.scaling.attn_factor"),
        }
    return out


PHI3 = register(
    Family(
        name="phi3",
        hf_architectures=("Phi3ForCausalLM",),
        hf_model_types=("phi3",),
        model="llmserve.engine.model.families.phi3:Phi3ForCausalLM",
        read_hf=_phi3_hf,
        gguf_architecture="phi3",
        read_gguf=_phi3_gguf,
        gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    )
)
