"""Small things tests build for themselves: tiny random Llama checkpoints in the HF layout, a
byte-level tokenizer for them, scheduler requests. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.sampling import normalized
from protos.common_pb2 import SamplingParams

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 256 + len(SPECIAL_TOKENS)  # one token per byte, then the specials
EOS_TOKEN_ID = 258  # <|im_end|>
# llama3 rope scaling with a short original context, so prompts of 33+ tokens exercise it.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for the 256 byte values (what ByteLevel BPE vocabularies use)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def write_byte_tokenizer(directory: Path) -> None:
    """tokenizer.json (byte-level, no merges: token id = byte value) + tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": CHAT_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
            }
        )
    )


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
