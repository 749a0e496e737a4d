"""Text <-> token ids, and the model's chat template, built from the model's own files.

HF directories: tokenizer.json (+ tokenizer_config.json or chat_template.jinja for the template).
GGUF files: the byte-level BPE ("gpt2") vocabulary, merges and special tokens stored in the file,
assembled with the `tokenizers` library. No torch, no transformers.

A directory holding a config.json and no tokenizer.json nor weights is a shape to serve with
random weights (`--load-format dummy`, e.g. configs/llama-3-8b): it gets `Tokenizer.byte_level()`,
so a prompt of n bytes is n tokens; generated ids of 256 and above have no text (still streamed).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from common.model_config import ModelSourceError, read_gguf_fields

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined.
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# The Llama 3 pre-tokenizer split (tiktoken's cl100k pattern).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class ChatTemplateError(ValueError):
    """The chat template refused the messages (e.g. roles that do not alternate)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
    ):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        # tokenizer.json usually adds BOS in its post-processor; GGUF says so in metadata.
        self.add_bos_token = add_bos_token
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template: jinja2.Template | None = None
        self._token_bytes: dict[int, bytes] = {}

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_model_path(cls, path: Path) -> Tokenizer:
        if not path.is_dir():
            return cls._from_gguf(path)
        return cls.byte_level() if is_config_only(path) else cls._from_hf_dir(path)

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """Token id = byte value (0-255), no merges, no special tokens, no chat template."""
        byte_chars = {b: c for c, b in _unicode_to_bytes().items()}
        tokenizer = HFTokenizer(
            models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[], fuse_unk=False)
        )
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer, None, None, None, add_bos_token=False)

    @classmethod
    def _from_hf_dir(cls, path: Path) -> Tokenizer:
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

        return cls(
            tokenizer,
            template,
            token_str(cfg.get("bos_token")),
            token_str(cfg.get("eos_token")),
            add_bos_token=False,
        )

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        fields = read_gguf_fields(path)
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelSourceError(
                f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
                "'gpt2'); serve the model from an HF directory instead"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
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

        def token_at(key: str) -> str | None:
            idx = fields.get(key)
            return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

        return cls(
            tokenizer,
            fields.get("tokenizer.chat_template"),
            token_at("tokenizer.ggml.bos_token_id"),
            token_at("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        )

    # -- use ------------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it: ~1 s for a 1M-character prompt), so a
        # prompt tokenized on a worker thread leaves the gateway's event loop running.
        [encoding] = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoding.ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids.insert(0, self.bos_token_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level BPE tokens may hold part of a character;
        other tokenizers give the token's decoded text)."""
        if token_id not in self._token_bytes:
            self._token_bytes[token_id] = self._bytes_of(token_id)
        return self._token_bytes[token_id]

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            byte_values = _unicode_to_bytes()
            if all(c in byte_values for c in piece):
                return bytes(byte_values[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
        """The chat template's text for messages, as HF's apply_chat_template renders it."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a text prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template: {err}") from err

    def encode_chat(self, messages: list[ChatMessage]) -> list[int]:
        """Token ids of the rendered template; special tokens come from the template text."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)


def is_config_only(path: Path) -> bool:
    """An HF directory with a config.json but neither tokenizer.json nor weights."""
    return (
        (path / "config.json").is_file()
        and not (path / "tokenizer.json").is_file()
        and not any(path.glob("*.safetensors"))
    )


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
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


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
