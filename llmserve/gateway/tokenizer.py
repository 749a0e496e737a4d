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
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from llmserve.common.tokenizer_files import (
    TokenizerFiles,
    byte_level_files,
    is_config_only,
    load_tokenizer_files,
    unicode_to_bytes,
)
from llmserve.gateway.tool_formats import ToolFormat, tool_format_of
from llmserve.gateway.tool_prompt import ChatTurn as ChatMessage
from llmserve.gateway.tool_prompt import fallback_turns, template_messages, template_takes_tools

__all__ = ["ChatMessage", "ChatTemplateError", "Tokenizer", "is_config_only"]


class ChatTemplateError(ValueError):
    """The chat template refused the messages (e.g. roles that do not alternate)."""


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
        return cls.from_files(load_tokenizer_files(path))

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """Token id = byte value (0-255), no merges, no special tokens, no chat template."""
        return cls.from_files(byte_level_files())

    @classmethod
    def from_files(cls, files: TokenizerFiles) -> Tokenizer:
        return cls(
            files.tokenizer,
            files.chat_template,
            files.bos_token,
            files.eos_token,
            add_bos_token=files.add_bos_token,
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
            byte_values = unicode_to_bytes()
            if all(c in byte_values for c in piece):
                return bytes(byte_values[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls, from its chat template (gateway/tool_formats.py)."""
        return tool_format_of(self.chat_template, self.tokenizer.token_to_id)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text for messages, as HF's apply_chat_template renders it. With
        tools, or messages carrying tool calls or results: through the template when it takes
        tools, else in the Hermes format (gateway/tool_prompt.py). template_kwargs: more
        variables for the template (e.g. enable_thinking), never the ones set here."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a text prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        uses_tools = bool(tools) or any(m.tool_calls or m.role == "tool" for m in messages)
        extra: dict[str, Any] = {}
        if uses_tools and template_takes_tools(self.chat_template):
            rendered = template_messages(messages, self.tool_format.call_id)
            extra["tools"] = tools or None
        else:
            if uses_tools:
                messages = fallback_turns(messages, tools or [])
            rendered = [m.as_template_message() for m in messages]
        try:
            return self._template.render(
                messages=rendered,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **{**(template_kwargs or {}), **extra},
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template: {err}") from err

    def encode_chat(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the rendered template; special tokens come from the template text."""
        text = self.render_chat(messages, tools=tools, template_kwargs=template_kwargs)
        return self.encode(text, add_special_tokens=False)


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
