"""Text <-> token ids, and the model's chat template, built from the model's own files.

HF directories: tokenizer.json (+ tokenizer_config.json or chat_template.jinja for the template).
GGUF files: the byte-level BPE ("gpt2") vocabulary, merges and special tokens stored in the file,
assembled with the `tokenizers` library. No torch, no transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from llmserve.model_config import ModelSourceError, read_gguf_fields

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

    # -- loading --------------------------------------------------------------------------------

    @classmethod
    def from_model_path(cls, path: Path) -> Tokenizer:
        if path.is_dir():
            return cls._from_hf_dir(path)
        return cls._from_gguf(path)

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
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and ids[:1] != [self.bos_token_id]
        ):
            ids.insert(0, self.bos_token_id)
        return ids

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


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)
