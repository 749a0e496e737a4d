"""Tiny random mixture-of-experts checkpoints made by transformers from each family's config
class: 8 experts, top-2; Mixtral with a sliding window shorter than the test prompts;
Qwen3-MoE with renormalized top-k weights, an explicit head_dim and its second layer dense
(mlp_only_layers); Qwen2-MoE with a shared expert and plain top-k softmax weights. Saved as HF
directories with the byte tokenizer. Nothing is downloaded."""

from __future__ import annotations

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


def make_tiny_moe(directory: Path, family: str, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight model of `family`; biases, norms and routers randomized so they matter
    (a router of zeros would tie every expert)."""
    import torch
    import transformers

    class_name, fields = MOE_CONFIGS[family]
    config = getattr(transformers, class_name)(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or name.endswith(("gate.weight", "shared_expert_gate.weight")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory
