"""Rope settings as config.json spells them, read without torch (engine/model/layers.py computes the
frequencies)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.registry import ModelSourceError

ROPE_TYPES = ("llama3", "linear", "longrope", "yarn", "dynamic")


def rope_from_hf(params: Any, cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from one rope parameter set: `params` (transformers v5's
    `rope_parameters`, or one layer type's entry of it) when it is a dict, else the classic
    top-level `rope_theta` + `rope_scaling` of cfg."""
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    scaling.pop("partial_rotary_factor", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # early Phi-3 configs' name
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise ModelSourceError(
            f"rope_scaling type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})"
        )
    scaling["rope_type"] = rope_type
    if rope_type == "longrope" and "original_max_position_embeddings" not in scaling:
        scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    if rope_type == "yarn":
        # transformers: a top-level original_max_position_embeddings wins, else the dict's, else
        # max_position_embeddings (the context the scaling starts from).
        original = cfg.get("original_max_position_embeddings") or scaling.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
        )
        scaling["original_max_position_embeddings"] = int(original)
    if rope_type == "dynamic" and scaling.get("factor") is None:
        raise ModelSourceError("rope_scaling type 'dynamic' needs its 'factor'")
    return theta, scaling
