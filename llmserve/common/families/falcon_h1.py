"""Falcon-H1 (FalconH1ForCausalLM): every layer runs GQA attention (with rotary) and a Mamba-2
mixer side by side on the same normed input and adds both outputs to the residual, then a
SwiGLU MLP; muP multipliers throughout (embedding, attention in / out, key, SSM in / out and
the per-part mup vector of the mixer's in_proj, the MLP's gate and down, the LM head). Each
layer keeps KV and, per request, the Mamba-2 conv + SSM state in the request's state slot
(layer type "hybrid": common/state_layout.py's BOTH_LAYER_TYPES)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.granite_hybrid import GRANITE_HYBRID
from llmserve.common.families.registry import Family, ModelSourceError, register
from llmserve.common.mamba2_config import FalconMultipliers, mamba2_from_falcon_h1


def read_falcon_h1(cfg: Mapping[str, Any]) -> dict[str, Any]:
    act = str(cfg.get("hidden_act") or "silu")
    if act != "silu":
        raise ModelSourceError(f"Falcon-H1 hidden_act={act!r} is not served (silu only)")
    gate, down = (float(m) for m in cfg.get("mlp_multipliers") or (1.0, 1.0))
    num_heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads)
    try:
        mamba2 = mamba2_from_falcon_h1(cfg)
    except ValueError as e:
        raise ModelSourceError(f"Falcon-H1 config.json: {e}") from None
    num_layers = int(cfg["num_hidden_layers"])
    return {
        "layer_types": ("hybrid",) * num_layers,
        # the keys times key_multiplier: the same scores as the softmax scale times it
        "attention_scale": head_dim**-0.5 * float(cfg.get("key_multiplier") or 1.0),
        "embed_scale": float(cfg.get("embedding_multiplier") or 1.0),
        "falcon_multipliers": FalconMultipliers(
            attention_in=float(cfg.get("attention_in_multiplier") or 1.0),
            attention_out=float(cfg.get("attention_out_multiplier") or 1.0),
            ssm_out=float(cfg.get("ssm_out_multiplier") or 1.0),
            mlp_gate=gate,
            mlp_down=down,
            lm_head=float(cfg.get("lm_head_multiplier") or 1.0),
        ),
        "mamba2": mamba2,
        "state_layout": mamba2.layout(),
    }


FALCON_H1 = register(
    Family(
        name="falcon_h1",
        hf_architectures=("FalconH1ForCausalLM",),
        hf_model_types=("falcon_h1",),
        model="llmserve.engine.model.families.falcon_h1:FalconH1ForCausalLM",
        read_hf=read_falcon_h1,
        # tensor parallelism as Granite 4.0-H's (the Mamba heads, the attention heads, the MLP's
        # columns: engine/model/families/falcon_h1.py), pipeline parallelism by layers
        refuses=dict(GRANITE_HYBRID.refuses),
    )
)
