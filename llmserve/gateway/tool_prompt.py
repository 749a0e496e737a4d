"""Tools in the prompt, and tool calls out of the text: the chat template's own way when its
template takes `tools` (and renders `tool_calls` and `tool` messages), else our fallback, the
Hermes / Qwen format: the tools listed in the system message as JSON inside <tools></tools>,
each call the model makes a JSON object {"name", "arguments"} inside <tool_call></tool_call>,
each result sent back inside <tool_response></tool_response> in a user turn. (The built-in
SmolLM2 template has no tools, so it uses the fallback.) Either way the model's calls are read
from the text in the <tool_call> format, which is what Qwen's and Hermes' templates ask for.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


@dataclass(frozen=True)
class ChatTurn:
    """A chat message as the template sees it: role, text, and for tools the assistant's calls
    (OpenAI's [{"id", "type", "function": {"name", "arguments" (a JSON string)}}]) or the id of
    the call a tool message answers."""

    role: str
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str = ""
    reasoning: str = ""  # an assistant turn's thinking, sent back

    def as_template_message(self) -> dict[str, Any]:
        """role and content, and the thinking under both names templates read it by
        (gpt-oss's `thinking`, Qwen3's `reasoning_content`)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            message |= {"thinking": self.reasoning, "reasoning_content": self.reasoning}
        return message


def template_takes_tools(template: str | None) -> bool:
    return template is not None and "tools" in template and "tool_calls" in template


def template_messages(
    turns: list[ChatTurn], call_id: Callable[[str], str] = str
) -> list[dict[str, Any]]:
    """turns as a template that takes tools reads them (arguments as objects, as HF's
    templates expect); call_id: a call's id as the template wants it (the same for the call
    and the tool message answering it)."""
    out: list[dict[str, Any]] = []
    for t in turns:
        message = t.as_template_message()
        if t.tool_calls:
            message["tool_calls"] = [
                {
                    **c,
                    "id": call_id(str(c.get("id", ""))),
                    "function": {**c["function"], "arguments": _arguments(c)},
                }
                for c in t.tool_calls
            ]
        if t.tool_call_id:
            message["tool_call_id"] = call_id(t.tool_call_id)
        out.append(message)
    return out


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object: OpenAI's JSON text decoded, an object as it came (some
    clients send one), text that is not JSON as it is."""
    arguments = call["function"].get("arguments") or "{}"
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def call_text(name: str, arguments: Any) -> str:
    """One call in the Hermes format."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def fallback_turns(turns: list[ChatTurn], tools: list[dict[str, Any]]) -> list[ChatTurn]:
    """turns in plain roles (system, user, assistant) carrying tools in the Hermes format, for
    a template that knows nothing of tools."""
    out: list[ChatTurn] = []
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        text = (
            "You can call the functions described in <tools></tools> below.\n<tools>\n"
            f"{listing}\n</tools>\nTo call one, answer with a JSON object holding its name "
            f'and arguments inside tags, one call per pair of tags:\n{CALL_OPEN}\n{{"name": '
            f'"function name", "arguments": {{...}}}}\n{CALL_CLOSE}'
        )
        if turns and turns[0].role == "system":
            text = f"{turns[0].content}\n\n{text}"
            turns = turns[1:]
        out.append(ChatTurn("system", text))
    for t in turns:
        if t.role == "tool":
            body = f"<tool_response>\n{t.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.startswith("<tool_response>"):
                out[-1] = ChatTurn("user", f"{out[-1].content}\n{body}")
            else:
                out.append(ChatTurn("user", body))
        elif t.tool_calls:
            calls = [call_text(c["function"]["name"], _arguments(c)) for c in t.tool_calls]
            out.append(ChatTurn("assistant", "\n".join([t.content, *calls]).strip()))
        else:
            out.append(ChatTurn(t.role, t.content))
    return out


# -- reading calls back --------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_call(body: str, names: set[str]) -> dict[str, Any] | None:
    """One call from the text inside a pair of tags: OpenAI's tool call, or None when it is not
    a JSON object naming one of the tools, with object arguments."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    return call_object(value, names)


def call_object(value: Any, names: set[str]) -> dict[str, Any] | None:
    """OpenAI's tool call for a decoded call object ({"name", "arguments" or "parameters"}), or
    None when it does not name one of the tools with object arguments."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, names: set[str]) -> tuple[str, list[dict[str, Any]]]:
    """(the text outside the calls, the calls) of a whole answer. Text that only looks like a
    call (bad JSON, an unknown name) stays text."""
    calls: list[dict[str, Any]] = []
    content: list[str] = []
    at = 0
    for match in _CALL.finditer(text):
        call = parse_call(match.group(1), names)
        if call is None:
            continue
        content.append(text[at : match.start()])
        calls.append(call)
        at = match.end()
    content.append(text[at:])
    return "".join(content).strip() if calls else text, calls


class CallStream:
    """One streamed choice's text, split into content to stream now and whole calls: content
    that may be the start of a call is held back until it is one (or cannot be)."""

    def __init__(self, names: set[str]):
        self.names = names
        self.held = ""
        self.num_calls = 0

    def add(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to stream, calls completed) after text."""
        self.held += text
        out: list[str] = []
        calls: list[dict[str, Any]] = []
        while True:
            start = self.held.find(CALL_OPEN)
            if start < 0:
                keep = _partial_prefix(self.held, CALL_OPEN)
                out.append(self.held[: len(self.held) - keep])
                self.held = self.held[len(self.held) - keep :]
                break
            end = self.held.find(CALL_CLOSE, start)
            if end < 0:
                out.append(self.held[:start])
                self.held = self.held[start:]
                break
            body = self.held[start + len(CALL_OPEN) : end]
            call = parse_call(body.strip(), self.names)
            stop = end + len(CALL_CLOSE)
            if call is None:
                out.append(self.held[:stop])
            else:
                out.append(self.held[:start])
                calls.append(call)
            self.held = self.held[stop:]
        self.num_calls += len(calls)
        text_out = "".join(out)
        if self.num_calls and not text_out.strip():
            text_out = ""
        return text_out, calls

    def finish(self, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """What is still held at the end, and no more calls: text that never became a call, but
        not a call's unfinished markup when the answer was cut short (cut: max_tokens)."""
        rest, self.held = self.held, ""
        if cut and CALL_OPEN in rest:
            rest = rest[: rest.index(CALL_OPEN)]
        return ("" if self.num_calls and not rest.strip() else rest), []


def _partial_prefix(text: str, tag: str) -> int:
    """The length of text's longest suffix that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
