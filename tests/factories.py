"""Small things tests build for themselves: tiny random Llama checkpoints in the HF layout, a
byte-level tokenizer for them, scheduler requests. Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmserve.bench.byte_tokenizer import (  # the tests import them from here
    EOS_TOKEN_ID,
    TINY_VOCAB,
    write_byte_tokenizer,
)
from llmserve.common.sampling import normalized
from llmserve.protos.common_pb2 import SamplingParams

# llama3 rope scaling with a short original context, so prompts of 33+ tokens exercise it.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def make_tiny_llama(
    directory: Path,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 1024,
    initializer_range: float = 0.2,
    seed: int = 0,
    with_tokenizer: bool = True,
) -> Path:
    """A random-weight LlamaForCausalLM saved by transformers (config.json + safetensors).

    The large initializer_range keeps the top logits well apart, so greedy tokens do not flip on
    the last-bit differences between batch shapes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kwargs: dict[str, Any] = {}
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
        **kwargs,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # norms start at 1; perturb them so they are really tested
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    if with_tokenizer:
        write_byte_tokenizer(directory)
    return directory


def sampling(**fields: Any) -> SamplingParams:
    """common.SamplingParams with the server's defaults filled in (temperature 1.0, ...), as the
    gateway, the scheduler and the engine's mirror make them."""
    return normalized(SamplingParams(**fields))


def make_lora_adapter(
    base: Path,
    directory: Path,
    *,
    rank: int,
    target_modules: list[str],
    seed: int,
    alpha: float | None = None,
    use_rslora: bool = False,
) -> Path:
    """A PEFT LoRA adapter of the checkpoint at base, saved by peft (adapter_config.json +
    adapter_model.safetensors), A and B random (init_lora_weights=False, scaled up so the
    adapter changes greedy tokens)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=target_modules,
        init_lora_weights=False,
        use_rslora=use_rslora,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(directory)
    return directory
