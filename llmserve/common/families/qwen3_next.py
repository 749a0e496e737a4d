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

from llmserve.common.families.moe import MOE_GGUF_NAMES, MOE_REFUSES, gguf_num_layers, moe_gguf
from llmserve.common.families.qwen import QWEN3
from llmserve.common.families.registry import Family, register
from llmserve.common.moe_config import moe_from_hf
from llmserve.common.state_layout import GatedDeltaNetConfig, gated_delta_net_from_hf

_NO_STATE_ROLLBACK = (
    "a rejected proposal would leave the linear-attention layers' recurrent state advanced "
    "past it (no snapshot per proposed token yet)"
)


def read_qwen3_next(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3NextConfig's shape: layer_types (every full_attention_interval-th layer full, by
    default), partial rotary (0.25 by default), the MoE and the DeltaNet layers' shape."""
    num_layers = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("full_attention_interval") or 4)
    default_types = _layer_types(num_layers, interval)
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


def _layer_types(num_layers: int, interval: int) -> tuple[str, ...]:
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


def read_qwen3_next_gguf(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """llama.cpp's `qwen3next` keys (convert_hf_to_gguf.py's Qwen3NextModel): the DeltaNet
    shape from `ssm.*` (group_count: key heads, time_step_rank: value heads, state_size: the
    key head dim, inner_size: all value heads' dims, conv_kernel), `full_attention_interval`,
    the rotary dims as `rope.dimension_count` (head_dim x partial_rotary_factor), the MoE as
    Qwen2-MoE's keys (top-k renormalised unless `expert_weights_norm` says otherwise, as
    llama.cpp's qwen3next graph does). Qwen3.5's `qwen35` / `qwen35moe` write the same keys,
    their MTP layer counted in block_count (gguf_num_layers)."""
    num_v_heads = int(fields[f"{arch}.ssm.time_step_rank"])
    delta_net = GatedDeltaNetConfig(
        num_k_heads=int(fields[f"{arch}.ssm.group_count"]),
        num_v_heads=num_v_heads,
        head_k_dim=int(fields[f"{arch}.ssm.state_size"]),
        head_v_dim=int(fields[f"{arch}.ssm.inner_size"]) // num_v_heads,
        conv_kernel=int(fields[f"{arch}.ssm.conv_kernel"]),
    )
    head_dim = int(fields[f"{arch}.attention.key_length"])
    num_layers = gguf_num_layers(fields, arch)
    interval = int(fields.get(f"{arch}.full_attention_interval") or 4)
    return {
        "num_layers": num_layers,
        "moe": moe_gguf(fields, arch) if f"{arch}.expert_count" in fields else None,
        "head_dim": head_dim,
        "partial_rotary_factor": int(fields[f"{arch}.rope.dimension_count"]) / head_dim,
        "layer_types": _layer_types(num_layers, interval),
        "gated_delta_net": delta_net,
        "state_layout": delta_net.layout(),
    }


# llama.cpp's names of a DeltaNet layer's tensors (its converter splits in_proj_qkvz into
# attn_qkv and attn_gate: engine/model/families/qwen3_next_gguf.py joins them back, and reads
# ssm_a and ssm_dt.bias, which carry no `.weight`) and of the attention's post-norm.
QWEN3_NEXT_GGUF_NAMES = {
    **QWEN3.gguf_layer_names,
    **MOE_GGUF_NAMES,
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "post_attention_norm": "post_attention_layernorm",
}


QWEN3_NEXT = register(
    Family(
        name="qwen3_next",
        hf_architectures=("Qwen3NextForCausalLM",),
        hf_model_types=("qwen3_next",),
        model="llmserve.engine.model.families.qwen3_next:Qwen3NextForCausalLM",
        read_hf=read_qwen3_next,
        gguf_architecture="qwen3next",
        read_gguf=read_qwen3_next_gguf,
        gguf_layer_names=QWEN3_NEXT_GGUF_NAMES,
        refuses={
            **MOE_REFUSES,
            "speculative_decoding": _NO_STATE_ROLLBACK,
            "lora": "its DeltaNet and gated attention projections take no adapters yet",
        },
    )
)
