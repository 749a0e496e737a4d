"""Write a tiny Mamba-2 hybrid checkpoint (tests/engine/model/families: Granite 4.0-H,
Nemotron-H, Falcon-H1) as a GGUF with the `gguf` package's writer, doing what llama.cpp's
converter does (convert_hf_to_gguf.py: Mamba2Model, GraniteHybridModel, NemotronHModel,
FalconH1Model): tensor names by gguf's own name map (the converter's map_tensor_name), dt_bias
as ssm_dt.bias, the conv squeezed to [C, K], A_log stored as ssm_a = -exp(A_log) and D as ssm_d,
both [H, 1], the mixer's norm as [groups, width / groups]; Granite's and Nemotron-H's attention
q / k rows permuted as Llama's (undo_permute), Granite's fused input_linear split into gate and
up (experts and shared MLP), Nemotron-H's per-expert tensors stacked; Falcon-H1's muP
multipliers multiplied into the weights; the keys each class writes (per-layer head_count_kv
and feed_forward_length, ssm.*, Granite's scales, the expert keys)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tests.family_gguf import add_byte_tokenizer, permute_qk

ARCH = {
    "GraniteMoeHybridForCausalLM": gguf.MODEL_ARCH.GRANITE_HYBRID,
    "NemotronHForCausalLM": gguf.MODEL_ARCH.NEMOTRON_H,
    "FalconH1ForCausalLM": gguf.MODEL_ARCH.FALCON_H1,
}


def _falcon_mup(name: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """FalconH1Model.modify_tensors: the multipliers baked into the weights."""
    if "down_proj" in name:
        return w * cfg["mlp_multipliers"][1]
    if "gate_proj" in name:
        return w * cfg["mlp_multipliers"][0]
    if "k_proj" in name:
        return w * cfg["key_multiplier"] * cfg["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return w * cfg["attention_in_multiplier"]
    if "o_proj" in name:
        return w * cfg["attention_out_multiplier"]
    if "out_proj" in name:
        return w * cfg["ssm_out_multiplier"]
    if "in_proj" in name:
        inner, bc = cfg["mamba_d_ssm"], cfg["mamba_n_groups"] * cfg["mamba_d_state"]
        cuts = np.cumsum([0, inner, inner, bc, bc, w.shape[0] - 2 * inner - 2 * bc])
        w = w * cfg["ssm_in_multiplier"]
        for m, a, b in zip(cfg["ssm_multipliers"], cuts[:-1], cuts[1:], strict=True):
            w[a:b] *= m
        return w
    if "lm_head" in name:
        return w * cfg["lm_head_multiplier"]
    if "embed_tokens" in name:
        return w * cfg["embedding_multiplier"]
    return w


def _mamba(name: str, w: np.ndarray, groups: int) -> np.ndarray:
    """Mamba2Model.modify_tensors' rewrites of a mixer's tensors."""
    if name.endswith("conv1d.weight"):
        return w.squeeze(1)
    if name.endswith("A_log"):
        return -np.exp(w).reshape(-1, 1)
    if name.endswith(".D"):
        return w.reshape(-1, 1)
    if re.search(r"\.(mamba|mixer)\.norm\.weight$", name):
        return w.reshape(groups, -1)
    return w


def _gguf_name(tmap: gguf.TensorNameMap, name: str) -> str:
    """The converter's map_tensor_name; the installed gguf maps Falcon-H1's
    `pre_ff_layernorm.weight` whole, dropping the suffix llama.cpp's files carry."""
    new = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
    assert new is not None, f"no GGUF name for {name}"
    suffix = name.rpartition(".")[2]
    return new if suffix not in ("weight", "bias") or new.endswith(suffix) else f"{new}.{suffix}"


def _tensors(
    hf: dict[str, np.ndarray], cfg: dict[str, Any], arch: gguf.MODEL_ARCH
) -> dict[str, np.ndarray]:
    kind = cfg["architectures"][0]
    tmap = gguf.get_tensor_name_map(arch, _num_layers(cfg))
    groups = cfg.get("mamba_n_groups") or cfg.get("n_groups")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, w in hf.items():
        name = name.replace(".dt_bias", ".dt_proj.bias")
        name = name.replace("_correction_bias", "_correction.bias")
        w = _mamba(name, w, groups)
        if kind == "FalconH1ForCausalLM":
            w = _falcon_mup(name, w, cfg)
        elif name.endswith("q_proj.weight"):
            w = permute_qk(w, heads)
        elif name.endswith("k_proj.weight"):
            w = permute_qk(w, kv_heads)
        expert = re.fullmatch(r"backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(\w+)\.\w+", name)
        if expert:
            stem = f"model.layers.{expert[1]}.mlp.experts.{expert[3]}.weight"
            stacks.setdefault(stem, {})[int(expert[2])] = w
            continue
        if name.endswith("input_linear.weight"):  # GraniteMoeModel: gate | up
            gate, up = np.split(w, 2, axis=-2)
            layer = name.split(".")[2]
            if "block_sparse_moe" in name:
                parts = ("ffn_gate_exps", "ffn_up_exps")
            else:
                parts = (
                    ("ffn_gate_shexp", "ffn_up_shexp")
                    if cfg["num_local_experts"]
                    else ("ffn_gate", "ffn_up")
                )
            out[f"blk.{layer}.{parts[0]}.weight"], out[f"blk.{layer}.{parts[1]}.weight"] = gate, up
            continue
        if name.endswith("shared_mlp.output_linear.weight") and not cfg.get("num_local_experts"):
            out[f"blk.{name.split('.')[2]}.ffn_down.weight"] = w
            continue
        out[_gguf_name(tmap, name)] = w
    for name, experts in stacks.items():
        out[_gguf_name(tmap, name)] = np.stack([experts[e] for e in sorted(experts)])
    return out


def _layer_kinds(cfg: dict[str, Any]) -> list[str]:
    kinds = cfg.get("layer_types") or cfg.get("layers_block_type")
    return list(kinds or ["hybrid"] * cfg["num_hidden_layers"])


def _num_layers(cfg: dict[str, Any]) -> int:
    return len(_layer_kinds(cfg))


def _head_dim(cfg: dict[str, Any]) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """The keys GraniteHybridModel / NemotronHModel / FalconH1Model write."""
    kind = cfg["architectures"][0]
    kinds, n = _layer_kinds(cfg), _num_layers(cfg)
    add_byte_tokenizer(w)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n)
    w.add_head_count(cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg.get("rms_norm_eps") or cfg.get("layer_norm_epsilon"))
    w.add_eos_token_id(cfg["eos_token_id"] or 2)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_ssm_conv_kernel(cfg.get("mamba_d_conv") or cfg.get("conv_kernel"))
    w.add_ssm_state_size(cfg.get("mamba_d_state") or cfg.get("ssm_state_size"))
    w.add_ssm_group_count(cfg.get("mamba_n_groups") or cfg.get("n_groups"))
    if kind == "FalconH1ForCausalLM":
        w.add_context_length(cfg["max_position_embeddings"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_key_length(_head_dim(cfg))
        w.add_value_length(_head_dim(cfg))
        w.add_ssm_inner_size(cfg["mamba_d_ssm"])
        w.add_ssm_time_step_rank(cfg["mamba_d_ssm"] // cfg["mamba_d_head"])
        w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
        return
    attention = [k in ("attention", "full_attention") for k in kinds]
    w.add_context_length(2**20)
    w.add_head_count_kv([cfg["num_key_value_heads"] if a else 0 for a in attention])
    if kind == "GraniteMoeHybridForCausalLM":
        _granite_metadata(w, cfg)
    else:
        _nemotron_metadata(w, cfg, kinds)


def _granite_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    w.add_feed_forward_length(cfg["intermediate_size"])
    if cfg["num_local_experts"]:
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_attention_scale(cfg["attention_multiplier"])
    w.add_embedding_scale(cfg["embedding_multiplier"])
    w.add_residual_scale(cfg["residual_multiplier"])
    w.add_logit_scale(cfg["logits_scaling"])
    w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    w.add_ssm_inner_size(cfg["mamba_expand"] * cfg["hidden_size"])
    w.add_ssm_time_step_rank(cfg["mamba_n_heads"])
    w.add_rope_scaling_finetuned(False)  # every hybrid: no rotary


def _nemotron_metadata(w: gguf.GGUFWriter, cfg: dict[str, Any], kinds: list[str]) -> None:
    moe = "moe" in kinds
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_ssm_inner_size(cfg["mamba_num_heads"] * cfg["mamba_head_dim"])
    w.add_ssm_time_step_rank(cfg["mamba_num_heads"])
    ffn = cfg["moe_intermediate_size"] if moe else cfg["intermediate_size"]
    w.add_feed_forward_length([ffn if k in ("mlp", "moe") else 0 for k in kinds])
    if moe:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(cfg["moe_shared_expert_intermediate_size"])
        w.add_expert_count(cfg["n_routed_experts"])
        w.add_expert_shared_count(cfg["n_shared_experts"])
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
        w.add_expert_weights_scale(cfg["routed_scaling_factor"])
        w.add_expert_group_count(cfg["n_group"])
        if cfg.get("moe_latent_size") is not None:
            w.add_moe_latent_size(cfg["moe_latent_size"])


def _quantized(name: str, data: np.ndarray) -> bool:
    """What the converter's --outtype q8_0 stores as Q8_0 (norms and the router stay float;
    here also any weight whose rows are not whole 32-value blocks)."""
    floats = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight")
    return not name.endswith(floats) and data.ndim == 2 and data.shape[-1] % 32 == 0


def write_mamba2_gguf(hf_dir: Path, path: Path, q8_0: bool = False) -> Path:
    """hf_dir's tiny Mamba-2 hybrid as a float32 GGUF at path (see the module), with the
    tests' byte tokenizer; the architecture (granitehybrid, nemotron_h / nemotron_h_moe,
    falcon-h1) from config.json, as the converter picks it. q8_0: the 2-D weights whose rows
    are whole 32-value blocks stored as Q8_0 (the converter's --outtype q8_0)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[cfg["architectures"][0]]
    if "moe" in _layer_kinds(cfg):  # NemotronHModel's choice (by MoE fields in config.json)
        arch = gguf.MODEL_ARCH.NEMOTRON_H_MOE
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    _metadata(w, cfg)
    hf = load_file(str(hf_dir / "model.safetensors"))
    for name, data in _tensors(hf, cfg, arch).items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        if q8_0 and _quantized(name, data):
            q = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q), raw_dtype=q)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
