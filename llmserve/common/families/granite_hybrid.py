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
from llmserve.common.mamba2_config import mamba2_from_granite, mamba2_gguf_shape
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


def read_granite_hybrid_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A `granitehybrid` GGUF (convert_hf_to_gguf.py's GraniteHybridModel) as
    read_granite_hybrid reads config.json: the attention layers are those with KV heads in
    the per-layer `attention.head_count_kv`; the mixer's shape from `ssm.*`; Granite's
    multipliers from attention.scale, embedding_scale, residual_scale and logit_scale; the
    MoE from expert_count (0 or absent: the shared MLP alone, stored as ffn_gate / ffn_up /
    ffn_down) and the shared MLP's width from expert_shared_feed_forward_length (absent:
    feed_forward_length). Rotary unless `rope.scaling.finetuned` is false (the converter
    writes false for every hybrid, as Granite 4.0-H attends without it)."""
    hidden = int(fields[f"{arch}.embedding_length"])
    kv = fields[f"{arch}.attention.head_count_kv"]
    num_layers = int(fields[f"{arch}.block_count"])
    kv = kv if isinstance(kv, list) else [kv] * num_layers
    try:
        shape = mamba2_gguf_shape(fields, arch)
    except ValueError as e:
        raise ModelSourceError(f"GGUF: {e}") from None
    cfg: dict[str, Any] = {
        "num_hidden_layers": num_layers,
        "hidden_size": hidden,
        "layer_types": ["attention" if int(n) > 0 else "mamba" for n in kv],
        "num_local_experts": int(fields.get(f"{arch}.expert_count") or 0),
        "num_experts_per_tok": fields.get(f"{arch}.expert_used_count"),
        "intermediate_size": int(fields[f"{arch}.feed_forward_length"]),
        "shared_intermediate_size": fields.get(f"{arch}.expert_shared_feed_forward_length")
        or fields[f"{arch}.feed_forward_length"],
        "position_embedding_type": (
            "rope" if fields.get(f"{arch}.rope.scaling.finetuned", True) else None
        ),
        "attention_multiplier": fields.get(f"{arch}.attention.scale"),
        "embedding_multiplier": fields.get(f"{arch}.embedding_scale"),
        "residual_multiplier": fields.get(f"{arch}.residual_scale"),
        "logits_scaling": fields.get(f"{arch}.logit_scale"),
        "mamba_n_heads": shape["heads"],
        "mamba_d_head": shape["head_dim"],
        "mamba_expand": shape["heads"] * shape["head_dim"] // hidden,
        "mamba_n_groups": shape["groups"],
        "mamba_d_state": shape["state_size"],
        "mamba_d_conv": shape["conv_kernel"],
        "mamba_conv_bias": shape["conv_bias"],
        "mamba_proj_bias": shape["proj_bias"],
    }
    try:
        return read_granite_hybrid(cfg)
    except ValueError as e:
        raise ModelSourceError(f"GGUF {arch}: {e}") from None


# llama.cpp's names of a Granite 4.0-H layer's tensors that differ from Llama's: the Mamba
# mixer (ssm_a, ssm_d and ssm_dt.bias are read by engine/model/families/mamba2_gguf.py), the
# experts' and the shared MLP's gate and up halves (`.gate_half` / `.up_half`: joined back into
# input_linear there; a dense model's shared MLP is ffn_gate / ffn_up / ffn_down).
GRANITE_HYBRID_GGUF_NAMES = {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
    "ffn_gate_inp": "block_sparse_moe.router.layer",
    "ffn_gate_exps": "block_sparse_moe.input_linear.gate_half",
    "ffn_up_exps": "block_sparse_moe.input_linear.up_half",
    "ffn_down_exps": "block_sparse_moe.output_linear",
    "ffn_gate_shexp": "shared_mlp.input_linear.gate_half",
    "ffn_up_shexp": "shared_mlp.input_linear.up_half",
    "ffn_down_shexp": "shared_mlp.output_linear",
    "ffn_gate": "shared_mlp.input_linear.gate_half",
    "ffn_up": "shared_mlp.input_linear.up_half",
    "ffn_down": "shared_mlp.output_linear",
}


GRANITE_HYBRID = register(
    Family(
        name="granite_hybrid",
        hf_architectures=("GraniteMoeHybridForCausalLM",),
        hf_model_types=("granitemoehybrid",),
        model="llmserve.engine.model.families.granite_hybrid:GraniteMoeHybridForCausalLM",
        read_hf=read_granite_hybrid,
        gguf_architecture="granitehybrid",
        read_gguf=read_granite_hybrid_gguf,
        gguf_layer_names=GRANITE_HYBRID_GGUF_NAMES,
        refuses={
            "speculative_decoding": "a rejected draft token would need the recurrent state "
            "rolled back",
            "quantization": "the Mamba-2 projections are not wired to the quantized linears",
            "lora": "adapters for the Mamba-2 and expert projections are not loaded",
        },
    )
)
