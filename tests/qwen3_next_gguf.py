"""Write a tiny Qwen3-Next checkpoint (tests/moe_models.make_tiny_moe) as a `qwen3next` GGUF with
the `gguf` package's writer, doing what llama.cpp's converter does (convert_hf_to_gguf.py,
Qwen3NextModel on top of Qwen2MoeModel): in_proj_qkvz split into attn_qkv ([q all heads | k |
v]) and attn_gate (z), A_log stored as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv
squeezed to [C, K], every norm but the DeltaNet's gated one stored as 1 + w, the experts
stacked, the ssm.* / full_attention_interval / rope.dimension_count keys. And a tiny Qwen3.5 /
Qwen3.5-MoE (tests/engine/model/families/test_qwen3_5.make_qwen3_5) as `qwen35` / `qwen35moe`
(write_qwen3_5_gguf): the same rewrites after _LinearAttentionVReorderBase's V-head reorder."""

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
    # Qwen3.5's flat projections
    "in_proj_qkv.weight": "attn_qkv.weight",
    "in_proj_z.weight": "attn_gate.weight",
    "in_proj_b.weight": "ssm_beta.weight",
    "in_proj_a.weight": "ssm_alpha.weight",
}


def _split_qkvz(w: np.ndarray, cfg: dict) -> tuple[np.ndarray, np.ndarray]:
    """The converter's order: [q, k, v, z] per key head -> [q all, k all, v all] and [z all]."""
    hk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    gv = cfg["linear_num_value_heads"] // hk * cfg["linear_value_head_dim"]
    grouped = w.reshape(hk, 2 * dk + 2 * gv, -1)
    q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + gv], axis=1)
    hidden = w.shape[-1]
    return np.concatenate([x.reshape(-1, hidden) for x in (q, k, v)]), z.reshape(-1, hidden)


def _tile(x: np.ndarray, axis: int, cfg: dict, size: int) -> np.ndarray:
    """The converter's _reorder_v_heads: value heads (each `size` wide along axis) from HF's
    grouped order [Hk, r] to tiled [r, Hk]."""
    hk = cfg["linear_num_key_heads"]
    r = cfg["linear_num_value_heads"] // hk
    shape = x.shape
    parts = (*shape[:axis], hk, r, size, *shape[axis + 1 :])
    return np.swapaxes(x.reshape(parts), axis, axis + 1).reshape(shape)


def _tile_value_heads(part: str, data: np.ndarray, cfg: dict) -> np.ndarray:
    """Qwen3.5's V-head reorder (_LinearAttentionVReorderBase), before Qwen3-Next's rewrites."""
    qk = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    dv = cfg["linear_value_head_dim"]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):
        return np.concatenate([data[:qk], _tile(data[qk:], 0, cfg, dv)])
    if part == "in_proj_z.weight":
        return _tile(data, 0, cfg, dv)
    if part in ("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias"):
        return _tile(data, 0, cfg, 1)
    if part == "out_proj.weight":
        return _tile(data, 1, cfg, dv)
    return data


def add_mtp_layer(out: dict[str, np.ndarray], layers: int, hidden: int) -> None:
    """A multi-token prediction layer where the converter puts a released checkpoint's (GLM-4.5's
    model.layers.{L}, Qwen3.5's mtp.*): blk.{L}, after the model's L layers: a copy of the last
    layer's tensors and the nextn ones (random: the engine must not read them)."""
    rng = np.random.default_rng(0)
    for name, data in list(out.items()):
        if name.startswith(f"blk.{layers - 1}."):
            out[name.replace(f"blk.{layers - 1}.", f"blk.{layers}.", 1)] = data
    out[f"blk.{layers}.nextn.eh_proj.weight"] = rng.standard_normal((hidden, 2 * hidden))
    for norm in ("enorm", "hnorm", "shared_head_norm"):
        out[f"blk.{layers}.nextn.{norm}.weight"] = rng.standard_normal(hidden)


def _tensors(hf: dict[str, np.ndarray], cfg: dict, qwen3_5: bool) -> dict[str, np.ndarray]:
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
            data = _tile_value_heads(part, data, cfg) if qwen3_5 else data
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
    tests/moe_models.write_moe_gguf takes it (the stack tests call either). family qwen3_5:
    write_qwen3_5_gguf's."""
    assert family in ("qwen3_next", "qwen3_5"), family
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    qwen3_5, layers = family == "qwen3_5", cfg["num_hidden_layers"]
    arch = ("qwen35moe" if "num_experts" in cfg else "qwen35") if qwen3_5 else "qwen3next"
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, "qwen3", {**cfg, "num_hidden_layers": layers + qwen3_5}, eot_token_id)
    if "num_experts" in cfg:
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if qwen3_5:
        w.add_nextn_predict_layers(1)
        w.add_rope_dimension_sections([*cfg["rope_parameters"]["mrope_section"], 0])
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_full_attention_interval(4)
    factor = cfg["rope_parameters"]["partial_rotary_factor"]
    w.add_rope_dimension_count(int(cfg["head_dim"] * factor))
    tensors = _tensors(load_file(str(hf_dir / "model.safetensors")), cfg, qwen3_5)
    if qwen3_5:
        add_mtp_layer(tensors, layers, cfg["hidden_size"])
    for name, data in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen3_5_gguf(hf_dir: Path, path: Path, eot_token_id: int | None = None) -> Path:
    """hf_dir's tiny Qwen3.5 (dense: `qwen35`) or Qwen3.5-MoE (`qwen35moe`) as llama.cpp's
    converter writes it (Qwen3_5TextModel / Qwen3_5MoeTextModel): Qwen3-Next's rewrites on the
    flat projections, the value heads tiled first, a multi-token prediction layer after the
    model's as a released checkpoint's `mtp.*` becomes (add_mtp_layer), the mrope sections."""
    return write_qwen3_next_gguf(hf_dir, path, "qwen3_5", eot_token_id)
