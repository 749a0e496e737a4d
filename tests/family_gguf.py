"""Write a tiny family checkpoint (tests/family_models.py) as a GGUF with the `gguf` package's
writer, as llama.cpp's converter lays it out for that architecture: its tensor names
(gguf.TENSOR_NAMES) and metadata keys, q/k rows permuted for the Llama architecture (Mistral
converts as Llama), norms stored as 1 + w for Gemma, Phi-3's fused projections kept fused and
its longrope factors as tensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np

ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "mistral": "llama",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "llama-yarn": "llama",
    "smollm3": "smollm3",
}
T = gguf.MODEL_TENSOR
# our HF layer-tensor stem -> llama.cpp's tensor, per architecture
_LAYER = {
    "input_layernorm": T.ATTN_NORM,
    "self_attn.q_proj": T.ATTN_Q,
    "self_attn.k_proj": T.ATTN_K,
    "self_attn.v_proj": T.ATTN_V,
    "self_attn.o_proj": T.ATTN_OUT,
    "self_attn.q_norm": T.ATTN_Q_NORM,
    "self_attn.k_norm": T.ATTN_K_NORM,
    "post_attention_layernorm": T.FFN_NORM,
    "mlp.gate_proj": T.FFN_GATE,
    "mlp.up_proj": T.FFN_UP,
    "mlp.down_proj": T.FFN_DOWN,
}
_GEMMA = {
    "post_attention_layernorm": T.ATTN_POST_NORM,
    "pre_feedforward_layernorm": T.FFN_NORM,
    "post_feedforward_layernorm": T.FFN_POST_NORM,
}
_PHI3 = {"self_attn.qkv_proj": T.ATTN_QKV, "mlp.gate_up_proj": T.FFN_UP}


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's rotary row order for the Llama architecture: per head (0, d/2, 1, ...)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(family: str, hf_name: str) -> str | None:
    globals_ = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    stem, _, kind = rest.rpartition(".")
    table = {**_LAYER, **(_GEMMA if family.startswith("gemma") else {}), **_PHI3}
    if stem not in table:
        return None
    return gguf.TENSOR_NAMES[table[stem]].format(bid=i) + "." + kind


def add_byte_tokenizer(w: gguf.GGUFWriter, eot_token_id: int | None = None) -> None:
    """The tests' byte tokenizer (llmserve/bench/byte_tokenizer.py) as GGUF tokenizer metadata:
    byte-level BPE ("gpt2") of the 256 byte tokens and no merges, the three specials as control
    tokens, its chat template; eot_token_id: a second end token (llama.cpp's eot), which stops
    generation as the EOS does."""
    from llmserve.bench.byte_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS
    from llmserve.common.tokenizer_files import unicode_to_bytes

    byte_chars = {b: c for c, b in unicode_to_bytes().items()}
    w.add_tokenizer_model("gpt2")
    w.add_token_list([byte_chars[b] for b in range(256)] + SPECIAL_TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 3)
    w.add_chat_template(CHAT_TEMPLATE)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)


def _metadata(
    w: gguf.GGUFWriter, family: str, cfg: dict[str, Any], eot_token_id: int | None = None
) -> None:
    add_byte_tokenizer(w, eot_token_id)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope = cfg["rope_parameters"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    if "intermediate_size" in cfg:  # Qwen3.5-MoE's has none (the converter writes it if there)
        w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_vocab_size(cfg["vocab_size"])
    if family != "phi3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if cfg.get("sliding_window"):
        w.add_sliding_window(cfg["sliding_window"])
    if family.startswith("gemma"):
        sliding = [t == "sliding_attention" for t in cfg["layer_types"]]
        w.add_sliding_window_pattern(sliding)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                getattr(w, f"add_{key}")(cfg[key])
    if family == "gemma3":
        rope, local = rope["full_attention"], rope["sliding_attention"]
        w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes it
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def write_family_gguf(
    hf_dir: Path, path: Path, family: str, eot_token_id: int | None = None, q8: bool = False
) -> Path:
    """hf_dir (a tiny `family` model) converted to a float32 GGUF at path, with the byte
    tokenizer (add_byte_tokenizer); q8: the layers' projections stored as Q8_0 blocks."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), ARCH[family])
    _metadata(w, family, cfg, eot_token_id)
    for hf_name, data in hf.items():
        name = _gguf_name(family, hf_name)
        if name is None:
            raise AssertionError(f"no GGUF name for {hf_name}")
        permuted = ARCH[family] in ("llama", "smollm3")  # llama.cpp's Llama converter
        if permuted and ".attn_q." in name:
            data = permute_qk(data, cfg["num_attention_heads"])
        elif permuted and ".attn_k." in name:
            data = permute_qk(data, cfg["num_key_value_heads"])
        elif family.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + 1.0
        data = np.ascontiguousarray(data, dtype=np.float32)
        if q8 and name.startswith("blk.") and data.ndim == 2:
            q8_0 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q8_0), raw_dtype=q8_0)
            continue
        w.add_tensor(name, data)
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "longrope":
        for which in ("short", "long"):
            factors = np.array(rope[f"{which}_factor"], dtype=np.float32)
            w.add_tensor(f"rope_factors_{which}.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
