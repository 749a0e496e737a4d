"""A model's tokenizer as its files give it, with no torch and no transformers: the `tokenizers`
tokenizer, the chat template and the special tokens. The gateway builds its Tokenizer (text <->
ids, the template) on it; the engine builds the grammar matchers' vocabulary on it.

HF directories: tokenizer.json (+ tokenizer_config.json or chat_template.jinja for the template).
GGUF files: the byte-level BPE ("gpt2") vocabulary, merges and special tokens stored in the file,
or its SentencePiece ("llama") pieces and scores (common/gguf_spm.py), assembled with the
`tokenizers` library. A directory holding a config.json and no tokenizer.json
nor weights is a shape served with random weights: it gets the byte-level tokenizer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from llmserve.common.gguf_spm import spm_tokenizer
from llmserve.common.model_config import ModelSourceError, read_gguf_fields

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# The Llama 3 pre-tokenizer split (tiktoken's cl100k pattern).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer: HFTokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    # tokenizer.json usually adds BOS in its post-processor; GGUF says so in metadata.
    add_bos_token: bool


def load_tokenizer_files(path: Path) -> TokenizerFiles:
    """The tokenizer of the model at path (a GGUF file or an HF directory); ModelSourceError
    when the files hold none this can build."""
    if not path.is_dir():
        return _from_gguf(path)
    return byte_level_files() if is_config_only(path) else _from_hf_dir(path)


def byte_level_files() -> TokenizerFiles:
    """Token id = byte value (0-255), no merges, no special tokens, no chat template."""
    byte_chars = {b: c for c, b in unicode_to_bytes().items()}
    tokenizer = HFTokenizer(
        models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[], fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return TokenizerFiles(tokenizer, None, None, None, add_bos_token=False)


def _from_hf_dir(path: Path) -> TokenizerFiles:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise ModelSourceError(f"{path}: no tokenizer.json")
    tokenizer = HFTokenizer.from_file(str(tok_file))
    cfg: dict[str, Any] = {}
    if (path / "tokenizer_config.json").is_file():
        cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def token_str(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    return TokenizerFiles(
        tokenizer,
        template,
        token_str(cfg.get("bos_token")),
        token_str(cfg.get("eos_token")),
        add_bos_token=False,
    )


def check_gguf_tokenizer(path: Path, fields: dict[str, Any] | None = None) -> str:
    """The GGUF's tokenizer model when it is one we build: byte-level BPE ("gpt2": Llama 3,
    Qwen, SmolLM2) or SentencePiece ("llama": llama.cpp's Llama 2, Mistral, Mixtral, Gemma and
    Phi-3 conversions); ModelSourceError otherwise (`llmserve serve` refuses it at start)."""
    kind = (read_gguf_fields(path) if fields is None else fields).get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ModelSourceError(
            f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
            "'gpt2', and SentencePiece, 'llama'); serve the model from an HF directory instead"
        )
    return str(kind)


def _from_gguf(path: Path) -> TokenizerFiles:
    fields = read_gguf_fields(path)
    kind = check_gguf_tokenizer(path, fields)
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    tokenizer = spm_tokenizer(fields) if kind == "llama" else _byte_level_bpe(fields)

    def token_at(key: str) -> str | None:
        idx = fields.get(key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    return TokenizerFiles(
        tokenizer,
        fields.get("tokenizer.chat_template"),
        token_at("tokenizer.ggml.bos_token_id"),
        token_at("tokenizer.ggml.eos_token_id"),
        # llama.cpp's default: SentencePiece vocabularies add BOS, byte-level BPE ones do not
        add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
    )


def _byte_level_bpe(fields: dict[str, Any]) -> HFTokenizer:
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    # A vocabulary of bytes alone has no merges (the gguf writer then leaves the key out).
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tokenizer = HFTokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "llama-bpe":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type") or []
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, t in enumerate(types)
            if t in (_GGUF_CONTROL, _GGUF_USER_DEFINED)
        ]
    )
    return tokenizer


def is_config_only(path: Path) -> bool:
    """An HF directory with a config.json but neither tokenizer.json nor weights."""
    return (
        (path / "config.json").is_file()
        and not (path / "tokenizer.json").is_file()
        and not any(path.glob("*.safetensors"))
    )


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table, which byte-level BPE
    vocabularies are written in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in printable]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table
