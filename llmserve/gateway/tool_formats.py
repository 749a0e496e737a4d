"""How a model writes its tool calls, chosen from its chat template: the grammar that makes
`tool_choice` "required" or a named function produce only calls, and the reading of calls back
out of the text (whole, or streamed).

Four formats: hermes (`<tool_call>...</tool_call>`, also the fallback prompt of
gateway/tool_prompt.py for templates without tools), llama3_json, mistral (`[TOOL_CALLS]`) and
harmony (gpt-oss: a commentary message to `functions.NAME`, gateway/harmony.py).
Streamed, nothing of a call goes out before it is whole, so streamed calls equal the ones read
from the whole answer (tool_prompt.CallStream). The formats: docs/api.md#tool-calling.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from collections.abc import Callable
from typing import Any

from llmserve.gateway import harmony
from llmserve.gateway.tool_prompt import (
    CALL_CLOSE,
    CALL_OPEN,
    CallStream,
    call_object,
    parse_tool_calls,
    template_takes_tools,
)

PYTHON_TAG = "<|python_tag|>"
MISTRAL_CALLS = "[TOOL_CALLS]"
_DECODER = json.JSONDecoder()
_ALNUM = string.ascii_letters + string.digits
# a call in tags, or one cut off (by max_tokens) before its closing tag
_TAGGED = re.compile(re.escape(CALL_OPEN) + ".*?(?:" + re.escape(CALL_CLOSE) + "|$)", re.DOTALL)


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: function["parameters"]},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _json_call(functions: list[dict[str, Any]], arguments_key: str) -> str:
    """llguidance's %json rule for one call object of one of functions."""
    schema = {
        "anyOf": [_call_schema(f, arguments_key) for f in functions],
        # spaced as json.dumps and the templates' tojson write it
        "x-guidance": {
            "whitespace_flexible": False,
            "item_separator": ", ",
            "key_separator": ": ",
            "lenient": True,
        },
    }
    return f"%json {json.dumps(schema)}"


class ToolFormat:
    """Hermes / Qwen: calls in <tool_call> tags, anywhere in the answer."""

    name = "hermes"

    def calls_grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar (llguidance's) admitting one call of one of functions (one or more
        with parallel), with arguments that validate against its parameters."""
        repeat = '("\\n" call)*' if parallel else ""
        return (
            f"start: call {repeat}\n"
            f'call: "{CALL_OPEN}\\n" {_json_call(functions, "arguments")} "\\n{CALL_CLOSE}"\n'
        )

    def parse(self, text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
        """(text outside the calls, the calls) of a whole answer."""
        return parse_tool_calls(text, names)

    def stream(self, names: set[str]) -> CallStream | HeldCallStream:
        return CallStream(names)

    def strip_markup(self, text: str) -> str:
        """text (content left after parsing) without call markup: a call that did not parse
        (cut by max_tokens, an unknown name) is dropped, not shown as content."""
        return _TAGGED.sub("", text) if CALL_OPEN in text else text

    def call_id(self, call_id: str) -> str:
        """A call's id as the template is given it (OpenAI's ids as they came)."""
        return call_id


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"

    def calls_grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        repeat = '("; " call)*' if parallel else ""
        return f"start: call {repeat}\ncall: {_json_call(functions, 'parameters')}\n"

    def parse(self, text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
        """The answer is calls only when, after an optional <|python_tag|>, it is one or more
        call objects joined by ";" and nothing else."""
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        calls: list[dict[str, Any]] = []
        at = 0
        while at < len(body):
            try:
                value, end = _DECODER.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = call_object(value, names)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            rest = body[at:].lstrip()
            at = len(body) - len(rest)
            if rest.startswith(";"):
                at += 1 + len(rest[1:]) - len(rest[1:].lstrip())
            elif rest:
                return text, []
        return ("", calls) if calls else (text, [])

    def stream(self, names: set[str]) -> HeldCallStream:
        return HeldCallStream(self, names, _opens_llama3_call)

    def strip_markup(self, text: str) -> str:
        return text.split(PYTHON_TAG, 1)[0]


class MistralFormat(ToolFormat):
    name = "mistral"

    def __init__(self, calls_token_id: int | None = None):
        """calls_token_id: the tokenizer's [TOOL_CALLS] token (the grammar asks for that
        token, not for its spelling in plain text); None: the text."""
        self.calls_token_id = calls_token_id

    def calls_grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        opener = (
            f"<[{self.calls_token_id}]>"
            if self.calls_token_id is not None
            else json.dumps(MISTRAL_CALLS)
        )
        repeat = '(", " call)*' if parallel else ""
        return (
            f'start: {opener} "[" call {repeat} "]"\ncall: {_json_call(functions, "arguments")}\n'
        )

    def parse(self, text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
        """Calls are a JSON array (or one object) after [TOOL_CALLS]; text before it is
        content. Anything else stays text."""
        start = text.find(MISTRAL_CALLS)
        if start < 0:
            return text, []
        body = text[start + len(MISTRAL_CALLS) :].strip()
        try:
            value, end = _DECODER.raw_decode(body)
        except json.JSONDecodeError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [call_object(item, names) for item in items]
        if not calls or body[end:].strip() or any(c is None for c in calls):
            return text, []
        return text[:start].strip(), [c for c in calls if c is not None]

    def stream(self, names: set[str]) -> HeldCallStream:
        return HeldCallStream(self, names, _opens_mistral_calls)

    def strip_markup(self, text: str) -> str:
        return text.split(MISTRAL_CALLS, 1)[0]

    def call_id(self, call_id: str) -> str:
        """Mistral's templates refuse ids that are not 9 letters or digits: any other id is
        given as 9 characters derived from it (the same for a call and its result)."""
        if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
            return call_id
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        return "".join(_ALNUM[(digest >> (6 * i)) % 62] for i in range(9))


class HarmonyFormat(ToolFormat):
    """gpt-oss: a call is a message to functions.NAME whose body is the arguments object, and
    it ends the turn (<|call|>): one call per answer."""

    name = "harmony"

    def __init__(self, token_id: Callable[[str], int | None] = lambda _: None):
        """token_id: the tokenizer's id of a special token's text (the grammar asks for the
        tokens, not for their spelling in plain text)."""
        self.token_id = token_id

    def calls_grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """One analysis message or none, then one call (<|call|> ends it: an EOS, which the
        grammar leaves to the model)."""
        tag = functools.partial(harmony.grammar_tag, token_id=self.token_id)
        rules = []
        for i, f in enumerate(functions):
            header = json.dumps(f"commentary to=functions.{f['name']} ")
            rules.append(
                f"call{i}: {tag(harmony.CHANNEL)} {header} {tag(harmony.CONSTRAIN)} "
                f'"json" {tag(harmony.MESSAGE)} {_json_arguments(f["parameters"])}\n'
            )
        choice = " | ".join(f"call{i}" for i in range(len(functions)))
        return f"start: thinking? ({choice})\n{harmony.thinking_rule(self.token_id)}" + "".join(
            rules
        )

    def parse(self, text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
        return harmony.read_calls(text, names)

    def stream(self, names: set[str]) -> HeldCallStream:
        return HeldCallStream(self, names, harmony.opens_message)

    def strip_markup(self, text: str) -> str:
        return harmony.strip_calls(text)


def _json_arguments(parameters: dict[str, Any]) -> str:
    """llguidance's %json rule for arguments that validate against parameters, spaced as
    json.dumps writes them."""
    return f"%json {json.dumps({**parameters, 'x-guidance': harmony.JSON_SPACING})}"


def _opens_llama3_call(text: str) -> int | None:
    """Where the held part of a Llama 3 answer starts: 0 when it opens like a call (or may
    still: an empty start, a prefix of <|python_tag|>), None when it cannot be one."""
    head = text.lstrip()
    if not head or head.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(head):
        return 0
    return None


def _opens_mistral_calls(text: str) -> int | None:
    """Where [TOOL_CALLS] (or a prefix of it, at the end) starts in text; None: nowhere."""
    start = text.find(MISTRAL_CALLS)
    if start >= 0:
        return start
    for n in range(min(len(MISTRAL_CALLS) - 1, len(text)), 0, -1):
        if text.endswith(MISTRAL_CALLS[:n]):
            return len(text) - n
    return None


class HeldCallStream:
    """One streamed choice of a format whose calls are read whole: text streams until the
    point where a call may begin (`opens`); from there on it is held and read at `finish`."""

    def __init__(
        self, fmt: ToolFormat, names: set[str], opens: Callable[[str], int | None]
    ) -> None:
        self.fmt = fmt
        self.names = names
        self.opens = opens
        self.text = ""  # all of it
        self.num_sent = 0  # how much of text went out as content
        self.num_calls = 0

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to stream now, calls: always none before the end)."""
        self.text += text
        held_from = self.opens(self.text)
        # a held part once found stays held: the answer is read whole at the end
        limit = len(self.text) if held_from is None else held_from
        out = self.text[self.num_sent : max(limit, self.num_sent)]
        self.num_sent = max(limit, self.num_sent)
        return out, []

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """(the content not streamed yet, the calls) once the answer is whole: with calls, the
        content before them; without, all that was held, as text, unless the answer was cut
        short (cut: max_tokens) while a call had begun: a call's unfinished markup is never
        content."""
        _, calls = self.fmt.parse(self.text, self.names)
        self.num_calls = len(calls)
        held_from = self.opens(self.text)
        if held_from is None:
            return self.text[self.num_sent :], []
        if not calls and not cut:
            return self.text[self.num_sent :], []
        return self.text[self.num_sent : max(held_from, self.num_sent)], calls


def tool_format_of(
    chat_template: str | None, token_id: Callable[[str], int | None] = lambda _: None
) -> ToolFormat:
    """The call format the chat template asks for (hermes when it names none, and for the
    fallback prompt of a template without tools). token_id: the tokenizer's id of a special
    token's text (None when it has none)."""
    template = chat_template or ""
    if harmony.is_harmony_template(template):
        return HarmonyFormat(token_id)
    if CALL_OPEN in template or not template_takes_tools(template):
        return ToolFormat()
    if MISTRAL_CALLS in template:
        return MistralFormat(token_id(MISTRAL_CALLS))
    if PYTHON_TAG in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return Llama3JsonFormat()
    return ToolFormat()
