"""Phi-3 and Phi-4 (HF `Phi3ForCausalLM`): q/k/v and gate/up stored fused (split at load), a
rotary over part of each head (partial_rotary_factor), longrope scaling where the config names
it, a sliding window where it sets one."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.families.registry import Family, register


def _phi3_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters")
    params = params if isinstance(params, dict) else {}
    factor = cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
    window = cfg.get("sliding_window")
    return {
        "partial_rotary_factor": float(factor),
        "sliding_window": int(window) if window else None,
    }


PHI3 = register(
    Family(
        name="phi3",
        hf_architectures=("Phi3ForCausalLM",),
        hf_model_types=("phi3",),
        model="engine.families.phi3:Phi3ForCausalLM",
        read_hf=_phi3_hf,
    )
)
