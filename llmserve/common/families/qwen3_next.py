"""Qwen3-Next (Qwen3NextForCausalLM): hybrid linear attention. Three gated DeltaNet layers
(`linear_attention`: a short causal conv over q, k, v, then the gated delta rule, whose state
each request keeps in a scheduler-owned state slot) to each gated full-attention layer
(`full_attention`: q doubled with a per-head output gate, q/k norms, partial rotary); a
mixture of experts with a gated shared expert in every sparse layer; zero-centred RMSNorms
(scaled by 1 + w). docs/models.md#hybrid-linear-attention-qwen3-next.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.moe import MOE_REFUSES
from llmserve.common.families.registry import Family, register
from llmserve.common.moe_config import moe_from_hf
from llmserve.common.state_layout import gated_delta_net_from_hf

_NO_STATE_ROLLBACK = (
    "a rejected proposal would leave the linear-attention layers' recurrent state advanced "
    "past it (no snapshot per proposed token yet)"
)


def read_qwen3_next(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3NextConfig's shape: layer_types (every full_attention_interval-th layer full, by
    default), partial rotary (0.25 by default), the MoE and the DeltaNet layers' shape."""
    num_layers = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    default_types = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    ]
    params = cfg.get("rope_parameters") or {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25
    delta_net = gated_delta_net_from_hf(cfg)
    return {
        "moe": moe_from_hf(dict(cfg)) if int(cfg.get("num_experts") or 0) else None,
        "head_dim": int(cfg.get("head_dim") or 256),
        "partial_rotary_factor": float(factor),
        "layer_types": tuple(cfg.get("layer_types") or default_types),
        "gated_delta_net": delta_net,
        "state_layout": delta_net.layout(),
    }


QWEN3_NEXT = register(
    Family(
        name="qwen3_next",
        hf_architectures=("Qwen3NextForCausalLM",),
        hf_model_types=("qwen3_next",),
        model="llmserve.engine.model.families.qwen3_next:Qwen3NextForCausalLM",
        read_hf=read_qwen3_next,
        refuses={
            **MOE_REFUSES,
            "speculative_decoding": _NO_STATE_ROLLBACK,
            "lora": "its DeltaNet and gated attention projections take no adapters yet",
        },
    )
)
