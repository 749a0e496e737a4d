"""Reasoning output: a model whose template thinks in <think>...</think> (Qwen3, DeepSeek-R1's
distills, SmolLM3) writes its thinking first; the answer's text is split into the reasoning
(chat: `reasoning_content`; Responses: a reasoning item) and the content, streamed as it comes.

    prompt ends in an open <think>     (R1, Qwen3 thinking):  the answer starts inside
    template closed it (enable_thinking false) or none:         it starts outside
    outside, <think> opens the one thinking block; inside, </think> ends it

gpt-oss writes harmony instead (gateway/harmony.py: its analysis channel is the reasoning).
The parser is picked from the chat template (--reasoning-parser auto: harmony when the
template writes harmony's <|channel|>, the think parser when it writes <think>), or named by
--reasoning-parser. A think answer under a grammar (forced tool calls, response_format) is not
split: what the grammar admits is the answer (a harmony one is: its grammar lets it think first,
harmony.final_grammar).

Neighbours: gateway/openai_responses.py (chat) and gateway/responses_format.py call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.gateway.harmony import HarmonyStream, is_harmony_template
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.gateway.validation import ValidRequest

START, END = "<think>", "</think>"
_PROMPT_TAIL_TOKENS = 16  # enough for "<think>\n" however the vocabulary splits it


def parser_enabled(choice: str, chat_template: str | None) -> bool:
    """Whether answers are split, under --reasoning-parser choice."""
    if choice == "auto":
        return chat_template is not None and (
            START in chat_template or is_harmony_template(chat_template)
        )
    return choice != "none"


def speaks_harmony(choice: str, chat_template: str | None) -> bool:
    """Whether chat answers are read as harmony under --reasoning-parser choice (then they
    are decoded with their special tokens, and stop at harmony's <|return|> and <|call|>)."""
    return choice == "harmony" or (choice == "auto" and is_harmony_template(chat_template))


def opens_thinking(tokenizer: Tokenizer, prompt_token_ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside a thinking block (its generation prompt opened
    one), read from the prompt's last tokens."""
    tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return tail.rstrip().endswith(START)


def reasoning_stream(
    tokenizer: Tokenizer, parser: str, valid: ValidRequest, with_tools: bool = False
) -> ReasoningStream | HarmonyStream | None:
    """The splitter of one chat answer under --reasoning-parser parser (None: not split);
    with_tools: the request's calls are read (else a harmony call is dropped, not content)."""
    if not parser_enabled(parser, tokenizer.chat_template):
        return None
    if speaks_harmony(parser, tokenizer.chat_template):
        return HarmonyStream(keep_calls=with_tools)  # a grammar writes harmony too
    if valid.sampling.HasField("structured_output"):
        return None  # the grammar admits the answer from its first token: no thinking
    return ReasoningStream(inside=opens_thinking(tokenizer, valid.prompt_token_ids))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of text's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningStream:
    """One answer's text split into (reasoning, content) as it streams: text that may be the
    start of a tag is held back until it is one or cannot be. The whitespace that opens each
    part (the newlines around the tags) is dropped."""

    inside: bool
    ended: bool = False  # the one thinking block closed: the rest is content
    held: str = ""
    _strip: bool = field(default=True)  # drop whitespace before the part's first character
    reasoning_text: str = ""  # all reasoning so far

    def add(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send after text."""
        buf, self.held = self.held + text, ""
        reasoning, content = [], []
        while buf:
            tag = END if self.inside else (None if self.ended else START)
            at = buf.find(tag) if tag else -1
            if at >= 0:
                part, buf = buf[:at], buf[at + len(tag or "") :]
            else:
                keep = _partial_suffix(buf, tag) if tag else 0
                part, self.held, buf = buf[: len(buf) - keep], buf[len(buf) - keep :], ""
            self._emit(part, reasoning if self.inside else content)
            if at >= 0:
                self.ended, self.inside = self.inside, not self.inside
                self._strip = True
        out = "".join(reasoning)
        self.reasoning_text += out
        return out, "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the answer."""
        rest, self.held = self.held, ""
        parts: list[str] = []
        self._emit(rest, parts)
        text = "".join(parts)
        if self.inside:
            self.reasoning_text += text
            return text, ""
        return "", text

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole answer."""
        reasoning, content = self.add(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content

    def _emit(self, part: str, out: list[str]) -> None:
        if self._strip:
            part = part.lstrip()
            self._strip = not part
        if part:
            out.append(part)
