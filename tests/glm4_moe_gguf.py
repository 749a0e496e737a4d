"""Write a tiny GLM-4.5 checkpoint (tests/moe_models.py GLM4_MOE) as a `glm4moe` GGUF with the
`gguf` package's writer, as llama.cpp's converter (convert_hf_to_gguf.py, Glm4MoeModel) lays it
out: Qwen3's attention names (q/k/v biases, q/k norms), the post-attention norm as
`post_attention_norm`, each projection's experts stacked, DeepSeek's shared experts
(`ffn_*_shexp`) and correction bias (`exp_probs_b.bias`); block_count counting the MTP layer
(`nextn_predict_layers`, stored after the model's), leading_dense_block_count, the expert_*
keys with the sigmoid gating function, the groups (`expert_group_count` / `_used_count`), the
rotary dims; no key_length where config.json has no head_dim; no q / k permutation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

from tests.family_gguf import _gguf_name, add_byte_tokenizer
from tests.moe_models import _STACKED
from tests.qwen3_next_gguf import add_mtp_layer

_SPARSE = {  # our HF stem in a GLM layer -> llama.cpp's tensor
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction_bias": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
    "post_attention_layernorm": "post_attention_norm",
}


def _metadata(w: gguf.GGUFWriter, cfg: dict, layers: int, eot_token_id: int | None) -> None:
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    rope = cfg["rope_parameters"]
    add_byte_tokenizer(w, eot_token_id)
    w.add_block_count(layers + cfg["num_nextn_predict_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or hidden // heads
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.5)))
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_nextn_predict_layers(cfg["num_nextn_predict_layers"])


def _tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in hf.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if expert:
            stem = f"blk.{expert[1]}.{_STACKED[expert[3]]}.weight"
            stacks.setdefault(stem, {})[int(expert[2])] = data
            continue
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        stem = rest.removesuffix(".weight")
        if stem in _SPARSE:
            kind = "bias" if stem.endswith("_bias") else "weight"
            out[f"blk.{layer}.{_SPARSE[stem]}.{kind}"] = data
            continue
        name = _gguf_name("qwen3", hf_name)
        assert name is not None, f"no GGUF name for {hf_name}"
        out[name] = data
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def write_glm4_moe_gguf(
    hf_dir: Path, path: Path, family: str = "glm4_moe", eot_token_id: int | None = None
) -> Path:
    """hf_dir's tiny GLM-4.5 as a float32 `glm4moe` GGUF at path (see the module), its MTP
    layer (config.json's num_nextn_predict_layers; transformers' model has no tensors for it)
    written as a released checkpoint's would be (add_mtp_layer); the byte tokenizer with
    eot_token_id (tests/family_gguf.add_byte_tokenizer); family: as the stack tests pass it."""
    assert family == "glm4_moe", family
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    assert cfg["num_nextn_predict_layers"] == 1, cfg["num_nextn_predict_layers"]
    w = gguf.GGUFWriter(str(path), "glm4moe")
    _metadata(w, cfg, layers, eot_token_id)
    tensors = _tensors(load_file(str(hf_dir / "model.safetensors")))
    add_mtp_layer(tensors, layers, cfg["hidden_size"])
    for name, data in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
