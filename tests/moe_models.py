"""Tiny random mixture-of-experts checkpoints made by transformers from each family's config
class: 8 experts, top-2; Mixtral with a sliding window shorter than the test prompts;
Qwen3-MoE with renormalized top-k weights, an explicit head_dim and its second layer dense
(mlp_only_layers); Qwen2-MoE with a shared expert and plain top-k softmax weights. Saved as HF
directories with the byte tokenizer. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.factories import write_byte_tokenizer
from tests.family_models import COMMON, WINDOW

MOE = {"num_experts_per_tok": 2, "intermediate_size": 96}
QWEN = {**MOE, "num_experts": 8, "moe_intermediate_size": 32}
MIXTRAL = {**MOE, "num_local_experts": 8, "sliding_window": WINDOW, "intermediate_size": 32}
QWEN3_MOE = {**QWEN, "norm_topk_prob": True, "head_dim": 32, "mlp_only_layers": [1]}
QWEN2_MOE = {**QWEN, "shared_expert_intermediate_size": 48, "norm_topk_prob": False}
MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralConfig", MIXTRAL),
    "qwen3_moe": ("Qwen3MoeConfig", QWEN3_MOE),
    "qwen2_moe": ("Qwen2MoeConfig", QWEN2_MOE),
}
# DeepSeek-V3's MoE as GLM-4.5 has it (tests/engine/model/families/test_glm4_moe.py; its GGUF
# writer: tests/glm4_moe_gguf.py): 8 experts in 4 groups, the best 2 groups kept, top-2
# renormalized and scaled; one shared expert; layer 0 dense; partial rotary, q/k norms and q/k/v
# biases.
GLM4_MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_intermediate_size": 32,
    "intermediate_size": 96,
    "use_qk_norm": True,
    "attention_bias": True,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
}
# DeepSeek-V3 (tests/engine/model/families/test_deepseek_v3.py): GLM-4.5's MoE with multi-head
# latent attention, the q latent (q_lora_rank), DeepSeek's interleaved rotary pairs, yarn with both
# mscales; every head its own K/V in transformers (num_key_value_heads = heads). deepseek_v3_plain:
# q_proj without a q latent, rotate-half rotary, no rope scaling.
DEEPSEEK_V3 = {
    **{k: v for k, v in GLM4_MOE.items() if k not in ("use_qk_norm", "attention_bias")},
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "rope_interleave": True,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
}
DEEPSEEK_V3_PLAIN = {
    **DEEPSEEK_V3,
    "q_lora_rank": None,
    "rope_interleave": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
# gpt-oss (tests/engine/model/families/test_gpt_oss.py): 8 biased experts, top-2, the clamped SwiGLU
# with a limit the tiny model's activations reach; attention sinks; sliding (a 12-token window,
# shorter than the prompts) and full layers alternating; yarn without truncation.
GPT_OSS = {
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "intermediate_size": 32,
    "head_dim": 16,
    "sliding_window": WINDOW,
    "swiglu_limit": 1.5,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}
# Qwen3-Next (tests/engine/model/families/test_qwen3_next.py): three gated DeltaNet layers and a
# gated full-attention layer; 2 key heads serving 4 value heads; layer 1's MLP dense; partial
# rotary; a shared expert beside 8 routed ones.
QWEN3_NEXT = {
    **QWEN,
    "num_hidden_layers": 4,
    "head_dim": 16,
    "shared_expert_intermediate_size": 48,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
DEEPSEEK_MOE_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt_oss": ("GptOssConfig", GPT_OSS),
    "glm4_moe": ("Glm4MoeConfig", GLM4_MOE),
    "deepseek_v3": ("DeepseekV3Config", DEEPSEEK_V3),
    "deepseek_v3_plain": ("DeepseekV3Config", DEEPSEEK_V3_PLAIN),
    "qwen3_next": ("Qwen3NextConfig", QWEN3_NEXT),
}


def make_tiny_moe(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model of `family`; biases, norms and routers randomized so they matter
    (a router of zeros would tie every expert)."""
    import torch
    import transformers

    class_name, fields = {**MOE_CONFIGS, **DEEPSEEK_MOE_CONFIGS}[family]
    config = getattr(transformers, class_name)(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks", "gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():  # DeepSeek's correction bias: a buffer
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.5)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
_SPARSE = {  # our HF stem inside a sparse layer -> llama.cpp's tensor (per layer)
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_STACKED = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_STACKED.update(w1="ffn_gate_exps", w3="ffn_up_exps", w2="ffn_down_exps")


def write_moe_gguf(
    hf_dir: Path,
    path: Path,
    family: str,
    q8_attention: bool = False,
    eot_token_id: int | None = None,
) -> Path:
    """hf_dir (a tiny Qwen3-MoE, Qwen2-MoE or Mixtral) as a float32 GGUF laid out as llama.cpp's
    converter does: each projection's experts stacked in one tensor ([E, I, H] / [E, H, I]), the
    router `ffn_gate_inp`, the shared expert `ffn_*_shexp` and its gate a vector
    `ffn_gate_inp_shexp`; the expert keys (count, used count, widths, weights_norm). Mixtral is
    the Llama architecture with an expert count, its q / k rows permuted as Llama's.
    q8_attention: the attention projections stored as Q8_0 (what --quantization auto reads);
    the byte tokenizer with eot_token_id (tests/family_gguf.add_byte_tokenizer)."""
    import re

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.family_gguf import _gguf_name, _metadata, permute_qk

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    arch = GGUF_ARCH[family]
    w = gguf.GGUFWriter(str(path), arch)
    dense = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}.get(family, "mistral")
    _metadata(w, dense, cfg, eot_token_id)
    w.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if family != "mixtral":  # Mixtral's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for hf_name, data in hf.items():
        expert = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.experts\.(\d+)\.(\w+)\.weight", hf_name)
        if expert:
            stem = f"blk.{expert[1]}.{_STACKED[expert[3]]}.weight"
            stacks.setdefault(stem, {})[int(expert[2])] = data
            continue
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        stem = rest.removesuffix(".weight")
        if stem in _SPARSE:
            name = f"blk.{layer}.{_SPARSE[stem]}.weight"
            data = data.reshape(-1) if stem == "mlp.shared_expert_gate" else data
        else:
            name = _gguf_name("qwen3", hf_name)  # type: ignore[assignment]
        assert name is not None, f"no GGUF name for {hf_name}"
        if arch == "llama" and ".attn_q." in name:
            data = permute_qk(data, cfg["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in name:
            data = permute_qk(data, cfg["num_key_value_heads"])
        data = np.ascontiguousarray(data, dtype=np.float32)
        if q8_attention and ".attn_" in name and "norm" not in name:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
            continue
        w.add_tensor(name, data)
    for name, experts in stacks.items():
        stacked = np.stack([experts[e] for e in sorted(experts)])
        w.add_tensor(name, np.ascontiguousarray(stacked, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
