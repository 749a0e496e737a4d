"""Write a tiny DeepSeek-V3 checkpoint (tests/moe_models.py) as a `deepseek2` GGUF with the
`gguf` package's writer, as llama.cpp's converter lays it out: MQA metadata over the latent
(head_count_kv 1, key/value_length of the latent, key/value_length_mla of a head), kv_b_proj
split per head into attn_k_b (W_UK transposed) and attn_v_b, each projection's experts stacked,
the correction bias `exp_probs_b.bias`, the sigmoid gating function, yarn's mscale_all_dim as
`yarn_log_multiplier` (0.1 x); no q / k permutation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np

from tests.family_gguf import add_byte_tokenizer

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # our HF stem -> llama.cpp's deepseek2 tensor
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    rank, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    add_byte_tokenizer(w)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_vocab_size(cfg["vocab_size"])
    rope_parameters = cfg["rope_parameters"]
    w.add_rope_freq_base(rope_parameters["rope_theta"])
    w.add_rope_dimension_count(rope)
    if rope_parameters["rope_type"] == "yarn":  # the converter keeps mscale_all_dim alone
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope_parameters["factor"])
        w.add_rope_scaling_orig_ctx_len(rope_parameters["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope_parameters["mscale_all_dim"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope)
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])


def write_deepseek2_gguf(hf_dir: Path, path: Path) -> Path:
    """hf_dir (a tiny DeepSeek-V3 with rope_interleave) as a float32 GGUF."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    w = gguf.GGUFWriter(str(path), "deepseek2")
    _metadata(w, cfg)
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in load_file(str(hf_dir / "model.safetensors")).items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        if hf_name in _GLOBAL:
            w.add_tensor(_GLOBAL[hf_name], data)
            continue
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(\w+)\.weight", rest)
        if expert:
            stacks.setdefault(f"blk.{layer}.{_STACKED[expert[2]]}.weight", {})[int(expert[1])] = (
                data
            )
        elif rest == "self_attn.kv_b_proj.weight":  # llama.cpp's split, k_b transposed
            per_head = data.reshape(heads, nope + v, -1)
            k_b = np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1))
            w.add_tensor(f"blk.{layer}.attn_k_b.weight", k_b)
            w.add_tensor(f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(per_head[:, nope:]))
        elif rest == "mlp.gate.e_score_correction_bias":
            w.add_tensor(f"blk.{layer}.exp_probs_b.bias", data)
        else:
            stem, _, kind = rest.rpartition(".")
            w.add_tensor(f"blk.{layer}.{_LAYER[stem]}.{kind}", data)
    for name, experts in stacks.items():
        w.add_tensor(name, np.ascontiguousarray(np.stack([experts[e] for e in sorted(experts)])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
