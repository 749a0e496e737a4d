"""A byte-level tokenizer (token id = byte value, then three chat specials) for stacks without a
model: the echo engine's (engine/contract/echo.py) in the tests and in
bench/studies/fairness_study.py, and the
tests' tiny random Llama checkpoints. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB = 256 + len(SPECIAL_TOKENS)  # one token per byte, then the specials
EOS_TOKEN_ID = 258  # <|im_end|>


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


def write_byte_tokenizer(
    directory: Path,
    special_tokens: list[str] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
    eos_token: str = "<|im_end|>",
) -> None:
    """tokenizer.json (byte-level, no merges: token id = byte value, then special_tokens) +
    tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    for i, tok in enumerate(special_tokens):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": chat_template,
                "eos_token": eos_token,
                "bos_token": None,
            }
        )
    )
