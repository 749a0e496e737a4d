"""Incremental detokenization: turn a growing list of token ids into text deltas that are always
whole characters.

Decoding one token at a time is wrong for two reasons: a character may span several byte-level
tokens (a partial UTF-8 sequence decodes to U+FFFD), and SentencePiece-style tokenizers drop or add
spaces depending on the neighbouring tokens. So each step decodes a short window twice, with and
without the new tokens, and emits the difference once it no longer ends in a partial character:

    ids:  |<- earlier ->|<- prefix_offset .. read_offset ->|<- new tokens ->|
                         (already emitted, kept as context)
"""

from __future__ import annotations

from llmserve.gateway.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first delta (spacing of the first generated token).
_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        """Append token_ids; return the text they complete (may be empty while a character is
        still partial)."""
        self.ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (a trailing partial character becomes U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]
