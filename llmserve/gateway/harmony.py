"""gpt-oss's harmony format, read from the answer's text: each message is a header, then
`<|message|>`, then its body, ended by `<|end|>` (more follows), `<|return|>` (the answer is
done) or `<|call|>` (a tool call: the turn ends for its result):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.F <|constrain|>json<|message|>{}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the first message's `<|start|>assistant` is the prompt's). The channels become the APIs'
parts: analysis -> reasoning; final, and commentary sent to no one (a preamble) -> content;
a message to `functions.NAME` (in its header, after the channel or the role) -> a tool call.
Messages of other roles, and calls of built-in tools (browser, python), are dropped.

Read as text (the answer decoded with its special tokens kept), not with openai-harmony: that
library loads the o200k vocabulary from the network (hash-checked; no pip package ships it),
and no code here downloads at run time. Rendering is the model's own chat template's.

HarmonyStream splits the text into (reasoning, content) as reasoning.ReasoningStream does,
with each call message passed on in the content as one canonical piece of markup, which
tool_formats.HarmonyFormat reads into calls (as it reads the raw text of an answer under a
grammar). The format: docs/api.md#reasoning-output.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from llmserve.gateway.tool_prompt import call_object

if TYPE_CHECKING:  # validation imports the tokenizer, which imports the tool formats (here)
    from llmserve.gateway.validation import ValidRequest
    from llmserve.protos.common_pb2 import StructuredOutput

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
CONSTRAIN, END, RETURN, CALL = "<|constrain|>", "<|end|>", "<|return|>", "<|call|>"
_BODY_ENDS = (END, RETURN, CALL, START)  # a <|start|> in a body: the model skipped its end
STOP_TOKENS = (RETURN, CALL)  # the ends of an assistant turn: generation stops there
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"to=([^\s<]+)")
# One call message, as HarmonyStream passes it on or a constrained answer writes it: the header
# (from <|start|> or <|channel|>) up to <|message|>, then the arguments up to its end (or the
# text's end, when cut short).
_CALL_MESSAGE = re.compile(
    r"(?:<\|start\|>(?:(?!<\|).)*)?<\|channel\|>((?:(?!<\|message\|>).)*)<\|message\|>"
    r"(.*?)(?:<\|call\|>|<\|end\|>|<\|return\|>|(?=<\|start\|>)|$)",
    re.DOTALL,
)
_CALL_ROLE = re.compile(r"<\|start\|>((?:(?!<\|).)*)")


def is_harmony_template(chat_template: str | None) -> bool:
    """Whether a chat template writes harmony (gpt-oss's)."""
    return chat_template is not None and CHANNEL in chat_template and MESSAGE in chat_template


def harmony_request(valid: ValidRequest, token_id: Callable[[str], int | None]) -> ValidRequest:
    """valid as a harmony chat request: its text decoded with the markup (special tokens)
    kept, stopping at <|return|> and <|call|> whether or not the model's
    generation_config.json lists them (gpt-oss's does, beside <|endoftext|>), and a
    response_format applied to its final message (final_grammar)."""
    stops = set(valid.submit.stop_token_ids)
    for text in STOP_TOKENS:
        token = token_id(text)
        if token is not None and token not in stops:
            valid.submit.stop_token_ids.append(token)
    so = valid.submit.sampling.structured_output
    if valid.submit.sampling.HasField("structured_output"):
        wrapped = final_grammar(so, token_id)
        if wrapped is not None:
            so.grammar = wrapped  # the oneof's other kind is cleared
    return replace(valid, skip_special_tokens=False)


def grammar_tag(text: str, token_id: Callable[[str], int | None]) -> str:
    """A harmony tag in a Lark grammar: its special token by id (`<[200005]>`), or its text
    where the tokenizer has no such token."""
    token = token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def thinking_rule(token_id: Callable[[str], int | None]) -> str:
    """A Lark rule `thinking`: one analysis message, free text, and the next message's start."""
    tag = functools.partial(grammar_tag, token_id=token_id)
    return (
        f'thinking: {tag(CHANNEL)} "analysis" {tag(MESSAGE)} /(?s:.*)/ {tag(END)} {tag(START)} '
        '"assistant"\n'
    )


# JSON as json.dumps spaces it (the whitespace the other formats' grammars ask for)
JSON_SPACING = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": True,
}


def final_grammar(so: StructuredOutput, token_id: Callable[[str], int | None]) -> str | None:
    """A Lark grammar for an answer that may think first (one analysis message), then writes
    what so admits as its final message, which the model ends (<|return|>, an EOS: never in a
    grammar); None for a grammar of the client's own (applied from the first token)."""
    kind = so.WhichOneof("constraint")
    if kind == "json_schema":
        schema = json.loads(so.json_schema)
        if not isinstance(schema, dict):
            return None
        body = f"%json {json.dumps({**schema, 'x-guidance': JSON_SPACING})}"
    elif kind == "json_object":
        body = f"%json {json.dumps({'type': 'object', 'x-guidance': JSON_SPACING})}"
    elif kind == "regex":
        body = "/" + so.regex.replace("/", "\\/") + "/"
    elif kind == "choice":
        body = "(" + " | ".join(json.dumps(c) for c in so.choice.choices) + ")"
    else:
        return None
    tag = functools.partial(grammar_tag, token_id=token_id)
    return (
        f"start: thinking? answer\n{thinking_rule(token_id)}"
        f'answer: {tag(CHANNEL)} "final" {tag(MESSAGE)} {body}\n'
    )


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """The length of text's longest suffix that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


@dataclass(frozen=True)
class Header:
    """What a message's header says: its author's role, its channel, whom it is sent to."""

    role: str
    channel: str
    recipient: str

    @classmethod
    def parse(cls, text: str) -> Header:
        """A header's text, from after the previous message (a `<|start|>ROLE` or nothing:
        the prompt began the assistant's message) up to its <|message|>."""
        role = "assistant"
        if START in text:
            head = text.split(START)[-1].split(CHANNEL)[0].strip()
            role = head.split()[0] if head else ""
            text = text.split(START)[-1]
        channel = ""
        if CHANNEL in text:
            after = text.split(CHANNEL, 1)[1].split(CONSTRAIN)[0].strip()
            channel = after.split()[0] if after else ""
        found = _RECIPIENT.search(text)
        return cls(role, channel, found.group(1) if found else "")

    @property
    def kind(self) -> str:
        """reasoning, content, call or skip: where the body goes."""
        if self.role != "assistant":
            return "skip"
        if self.recipient:
            return "call" if self.recipient.startswith(FUNCTIONS) else "skip"
        return "reasoning" if self.channel == "analysis" else "content"


def call_markup(recipient: str, arguments: str, whole: bool = True) -> str:
    """A call message in the one form HarmonyFormat reads (whole: with its <|call|>)."""
    head = f"{START}assistant{CHANNEL}commentary to={recipient} {CONSTRAIN}json{MESSAGE}"
    return head + arguments + (CALL if whole else "")


@dataclass
class HarmonyStream:
    """One answer's harmony text split into (reasoning, content) as it streams; a call
    message goes into the content whole, as call_markup (with keep_calls). Text that may be the
    start of a tag is held back until it is one or cannot be."""

    keep_calls: bool = True  # False: call messages are dropped (the request has no tools)
    header: str = ""  # the open header's text (none yet: the prompt opened one)
    body: Header | None = None  # the open message's header, once its <|message|> came
    held: str = ""
    arguments: str = ""  # the open call's body so far
    num_messages: int = 0
    reasoning_text: str = ""  # all reasoning so far
    _out: dict[str, list[str]] = field(default_factory=dict)

    def add(self, text: str) -> tuple[str, str]:
        """(reasoning, content) to send after text."""
        buf, self.held = self.held + text, ""
        self._out = {"reasoning": [], "content": []}
        while buf:
            buf = self._in_header(buf) if self.body is None else self._in_body(buf)
        return self._take()

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the answer: an open message's rest (a cut call's
        markup without its <|call|>); text that never opened a message is content."""
        rest, self.held = self.held, ""
        self._out = {"reasoning": [], "content": []}
        if self.body is not None:
            self._emit(rest)
            self._close(whole=False)
        elif not self.num_messages and "<|" not in self.header:
            self._out["content"].append(self.header + rest)  # not harmony at all: plain text
        return self._take()

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole answer."""
        reasoning, content = self.add(text)
        more_reasoning, more_content = self.finish()
        return reasoning + more_reasoning, content + more_content

    def _in_header(self, buf: str) -> str:
        at = buf.find(MESSAGE)
        if at < 0:
            keep = _partial_tag(buf, (MESSAGE,))
            self.header += buf[: len(buf) - keep]
            self.held = buf[len(buf) - keep :]
            return ""
        self.body = Header.parse(self.header + buf[:at])
        self.header, self.arguments = "", ""
        self.num_messages += 1
        return buf[at + len(MESSAGE) :]

    def _in_body(self, buf: str) -> str:
        ends = [(at, tag) for tag in _BODY_ENDS if (at := buf.find(tag)) >= 0]
        if not ends:
            keep = _partial_tag(buf, _BODY_ENDS)
            self._emit(buf[: len(buf) - keep])
            self.held = buf[len(buf) - keep :]
            return ""
        at, tag = min(ends)
        self._emit(buf[:at])
        self._close(whole=True)
        # a <|start|> begins the next header; the other ends are consumed
        return buf[at:] if tag == START else buf[at + len(tag) :]

    def _emit(self, text: str) -> None:
        assert self.body is not None
        kind = self.body.kind
        if kind == "call":
            self.arguments += text
        elif kind != "skip" and text:
            self._out[kind].append(text)

    def _close(self, whole: bool) -> None:
        assert self.body is not None
        if self.body.kind == "call" and self.keep_calls:
            self._out["content"].append(call_markup(self.body.recipient, self.arguments, whole))
        self.body = None

    def _take(self) -> tuple[str, str]:
        reasoning = "".join(self._out["reasoning"])
        self.reasoning_text += reasoning
        return reasoning, "".join(self._out["content"])


# -- calls, read from the text (tool_formats.HarmonyFormat) -----------------------------------


def read_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the call messages, the calls) of a whole answer: each message to
    `functions.NAME` of one of names whose body is a JSON object. Text that only looks like a
    call (bad JSON, an unknown name) stays text."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    at = 0
    for match in _CALL_MESSAGE.finditer(text):
        header = _header(match)
        role = _CALL_ROLE.match(header)
        if role and role.group(1).split()[:1] != ["assistant"]:
            continue
        recipient = _RECIPIENT.search(header)
        if recipient is None or not recipient.group(1).startswith(FUNCTIONS):
            continue
        try:
            arguments = json.loads(match.group(2))
        except json.JSONDecodeError:
            continue
        name = recipient.group(1).removeprefix(FUNCTIONS)
        call = call_object({"name": name, "arguments": arguments}, names)
        if call is None:
            continue
        content.append(text[at : match.start()])
        calls.append(call)
        at = match.end()
    content.append(text[at:])
    return ("".join(content) if calls else text), calls


def strip_calls(text: str) -> str:
    """text without call messages (ones that did not parse: cut short, an unknown name)."""
    if CHANNEL not in text:
        return text
    return _CALL_MESSAGE.sub(lambda m: "" if _RECIPIENT.search(_header(m)) else m.group(0), text)


def _header(match: re.Match[str]) -> str:
    """A matched message's header: its text up to its <|message|>."""
    return match.group(0)[: match.start(2) - match.start()]


def opens_message(text: str) -> int | None:
    """Where the first harmony message (or a tag's prefix, at the end) starts in text; None:
    nowhere (the content so far is plain text)."""
    found = [at for tag in (START, CHANNEL) if (at := text.find(tag)) >= 0]
    if found:
        return min(found)
    keep = _partial_tag(text, (START, CHANNEL))
    return len(text) - keep if keep else None
