"""The mixture-of-experts families: Mixtral (Mistral's layers, every MLP a sparse block),
Qwen3-MoE (Qwen3's layers) and Qwen2-MoE (Qwen2's, with a shared expert beside the routed
ones). Their MoE shape is common/moe_config.py's `MoEConfig`, in ModelConfig.moe; the engine's
block is engine/moe.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from common.families.qwen import qwen_window
from common.families.registry import Family, register
from common.moe_config import moe_from_hf

MOE_REFUSES = {
    "quantization": (
        "the routed experts are not quantized yet (only Linear layers are), so --quantization "
        "would leave most of the weights as they are"
    ),
}


def _window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Mixtral and Qwen3-MoE: every layer windowed when sliding_window is set."""
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


MIXTRAL = register(
    Family(
        name="mixtral",
        hf_architectures=("MixtralForCausalLM",),
        hf_model_types=("mixtral",),
        model="engine.families.moe:MixtralForCausalLM",
        read_hf=lambda cfg: {"moe": moe_from_hf(dict(cfg)), **_window(cfg)},
        refuses=MOE_REFUSES,
    )
)

QWEN3_MOE = register(
    Family(
        name="qwen3_moe",
        hf_architectures=("Qwen3MoeForCausalLM",),
        hf_model_types=("qwen3_moe",),
        model="engine.families.moe:Qwen3MoeForCausalLM",
        read_hf=lambda cfg: {"moe": moe_from_hf(dict(cfg)), **_window(cfg)},
        refuses=MOE_REFUSES,
    )
)

QWEN2_MOE = register(
    Family(
        name="qwen2_moe",
        hf_architectures=("Qwen2MoeForCausalLM",),
        hf_model_types=("qwen2_moe",),
        model="engine.families.moe:Qwen2MoeForCausalLM",
        read_hf=lambda cfg: {
            "moe": moe_from_hf(dict(cfg)),
            "qkv_bias": bool(cfg.get("qkv_bias", True)),
            **qwen_window(cfg),
        },
        refuses=MOE_REFUSES,
    )
)
