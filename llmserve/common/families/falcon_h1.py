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
from llmserve.common.mamba2_config import (
    FalconMultipliers,
    mamba2_from_falcon_h1,
    mamba2_gguf_shape,
)


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


def read_falcon_h1_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `falcon-h1` GGUF (convert_hf_to_gguf.py's FalconH1Model) as read_falcon_h1 reads
    config.json. The converter bakes every muP multiplier into the weights (the embedding,
    q / k / v, the key multiplier into k, o_proj, the mixer's in_proj by its five parts and
    ssm_in_multiplier, out_proj, the MLP's gate and down, the LM head) and writes none as a
    key, so all are 1 here. It records no mamba_norm_before_gate: a file with the mixer's
    norm (ssm_norm) is read with the gate applied first, as llama.cpp's Mamba-2 layer does."""
    try:
        shape = mamba2_gguf_shape(fields, arch)
    except ValueError as e:
        raise ModelSourceError(f"GGUF: {e}") from None
    cfg = {
        "num_hidden_layers": fields[f"{arch}.block_count"],
        "hidden_size": fields[f"{arch}.embedding_length"],
        "num_attention_heads": fields[f"{arch}.attention.head_count"],
        "head_dim": fields.get(f"{arch}.attention.key_length"),
        "mamba_d_ssm": shape["heads"] * shape["head_dim"],
        "mamba_n_heads": shape["heads"],
        "mamba_d_head": shape["head_dim"],
        "mamba_n_groups": shape["groups"],
        "mamba_d_state": shape["state_size"],
        "mamba_d_conv": shape["conv_kernel"],
        "mamba_conv_bias": shape["conv_bias"],
        "mamba_proj_bias": shape["proj_bias"],
        "projectors_bias": shape["out_bias"],
        "mamba_rms_norm": shape["gated_norm"],
        "mamba_norm_before_gate": False,
    }
    return read_falcon_h1(cfg)


# llama.cpp's names of a Falcon-H1 layer's tensors that differ from Llama's (ssm_a, ssm_d and
# ssm_dt.bias: the engine's mamba2_gguf; the final norm: FalconH1ForCausalLM.hf_tensors).
FALCON_H1_GGUF_NAMES = {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
    "ffn_norm": "pre_ff_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
}

FALCON_H1 = register(
    Family(
        name="falcon_h1",
        hf_architectures=("FalconH1ForCausalLM",),
        hf_model_types=("falcon_h1",),
        model="llmserve.engine.model.families.falcon_h1:FalconH1ForCausalLM",
        read_hf=read_falcon_h1,
        gguf_architecture="falcon-h1",
        read_gguf=read_falcon_h1_gguf,
        gguf_layer_names=FALCON_H1_GGUF_NAMES,
        # tensor parallelism as Granite 4.0-H's (the Mamba heads, the attention heads, the MLP's
        # columns: engine/model/families/falcon_h1.py), pipeline parallelism by layers
        refuses=dict(GRANITE_HYBRID.refuses),
    )
)
