"""gpt-oss (GptOssForCausalLM): GQA with q/k/v/o biases and attention sinks (a learned logit
per head in each softmax's denominator), layers alternating a 128-token sliding window and full
attention (`layer_types`), yarn rope, and a mixture of experts with a biased router and biased
experts under the clamped SwiGLU (common/moe_config.py). Float experts only: the released
MXFP4 checkpoints are the checkpoint-format loader's (engine/checkpoint_formats.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.moe import MOE_REFUSES
from llmserve.common.families.registry import Family, register
from llmserve.common.moe_config import moe_from_hf


def read_gpt_oss(cfg: Mapping[str, Any]) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    return {
        "moe": moe_from_hf(dict(cfg)),
        "attention_bias": bool(cfg.get("attention_bias", True)),
        "attention_sinks": True,
        "sliding_window": int(window) if window else None,
        "layer_types": tuple(cfg.get("layer_types") or ()),
    }


GPT_OSS = register(
    Family(
        name="gpt_oss",
        hf_architectures=("GptOssForCausalLM",),
        hf_model_types=("gpt_oss",),
        model="llmserve.engine.families.gpt_oss:GptOssForCausalLM",
        read_hf=read_gpt_oss,
        refuses={
            **MOE_REFUSES,
            "tensor_parallel": "the sinks and the fused biased experts are not split yet",
            "pipeline_parallel": "not tested with gpt-oss yet",
        },
    )
)
