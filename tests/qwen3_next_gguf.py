"""Write a tiny Qwen3-Next checkpoint (tests/moe_models.make_tiny_moe) as a `qwen3next` GGUF with
the `gguf` package's writer, doing what llama.cpp's converter does (convert_hf_to_gguf.py,
Qwen3NextModel on top of Qwen2MoeModel): in_proj_qkvz split into attn_qkv ([q all heads | k |
v]) and attn_gate (z), A_log stored as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv
squeezed to [C, K], every norm but the DeltaNet's gated one stored as 1 + w, the experts
stacked, the ssm.* / full_attention_interval / rope.dimension_count keys."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

from tests.family_gguf import _gguf_name, _metadata
from tests.moe_models import _SPARSE, _STACKED

T = gguf.MODEL_TENSOR
_DELTA = {
    "in_proj_ba.weight": "ssm_ba.weight",
    "conv1d.weight": "ssm_conv1d.weight",
    "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
    "A_log": "ssm_a",
    "dt_bias": "ssm_dt.bias",
}


def _split_qkvz(w: np.ndarray, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """The converter's order: [q, k, v, z] per key head -> [q all, k all, v all] and [z all]."""
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    gv = cfg["linear_num_value_heads"] // hk * cfg["linear_value_head_dim"]
    grouped = w.reshape(hk, 2 * dk + 2 * gv, -1)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + gv], axis=1)
    hidden = w.shape[-1]
    return np.concatenate([x.reshape(-1, hidden) for x in (q, k, v)]), z.reshape(-1, hidden)


def _tensors(hf: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in hf.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if expert:
            stem = f"blk.{expert[1]}.{_STACKED[expert[3]]}.weight"
            stacks.setdefault(stem, {})[int(expert[2])] = data
            continue
        if hf_name.endswith("norm.weight") and ".linear_attn." not in hf_name:
            data = data + 1.0
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        if rest.startswith("linear_attn."):
            part = rest.removeprefix("linear_attn.")
            if part == "in_proj_qkvz.weight":
                qkv, z = _split_qkvz(data, cfg)
                out[f"blk.{layer}.attn_qkv.weight"], out[f"blk.{layer}.attn_gate.weight"] = qkv, z
                continue
            if part == "A_log":
                data = -np.exp(data)
            elif part == "conv1d.weight":
                data = data.squeeze(1)
            out[f"blk.{layer}.{_DELTA[part]}"] = data
        elif rest.removesuffix(".weight") in _SPARSE:
            stem = rest.removesuffix(".weight")
            data = data.reshape(-1) if stem == "mlp.shared_expert_gate" else data
            out[f"blk.{layer}.{_SPARSE[stem]}.weight"] = data
        elif rest == "post_attention_layernorm.weight":
            out[gguf.TENSOR_NAMES[T.ATTN_POST_NORM].format(bid=layer) + ".weight"] = data
        else:
            name = _gguf_name("qwen3", hf_name)
            assert name is not None, f"no GGUF name for {hf_name}"
            out[name] = data
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def write_qwen3_next_gguf(
    hf_dir: Path, path: Path, family: str = "qwen3_next", eot_token_id: int | None = None
) -> Path:
    """hf_dir's tiny Qwen3-Next as a float32 `qwen3next` GGUF at path (see the module), with
    the byte tokenizer and eot_token_id (tests/family_gguf.add_byte_tokenizer); family: as
    tests/moe_models.write_moe_gguf takes it (the stack tests call either)."""
    assert family == "qwen3_next", family
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), "qwen3next")
    _metadata(w, "qwen3", cfg, eot_token_id)
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(4)
    factor = cfg["rope_parameters"]["partial_rotary_factor"]
    w.add_rope_dimension_count(int(cfg["head_dim"] * factor))
    for name, data in _tensors(load_file(str(hf_dir / "model.safetensors")), cfg).items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
