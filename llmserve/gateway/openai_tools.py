"""Tool calling in the OpenAI chat API: `tools`, `tool_choice` and `parallel_tool_calls` checked
and turned into what the request carries (the tools for the template, and for `required` or a
named function a grammar that admits only calls, in the model's format: gateway/tool_formats.py),
and the answer read back into `message.tool_calls`. No mode puts call markup into `content`: a
forced answer's content is empty, and an auto answer's unparsed markup is dropped. What each
tool_choice does: docs/api.md#tool-calling.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmserve.common.structured_output import ConstraintError, check_structured_output
from llmserve.gateway.tool_formats import ToolFormat
from llmserve.gateway.validation import ValidationError
from llmserve.protos.common_pb2 import StructuredOutput

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools come to: the tools to render (none for tool_choice none),
    the grammar that enforces calls (None: free text), and the names calls are read back for
    (empty: no reading back)."""

    tools: list[dict[str, Any]]
    constraint: StructuredOutput | None
    names: frozenset[str]
    max_calls: int | None = None  # 1: a named function, or parallel_tool_calls false


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool,
    fmt: ToolFormat | None = None,
) -> ToolPlan:
    """fmt: the model's call format (Hermes when None). Raises ValidationError naming the
    field (an unknown tool_choice function included)."""
    fmt = fmt or ToolFormat()
    functions = _functions(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if choice == "none":
        return ToolPlan([], None, frozenset())
    one = None if parallel else 1
    if not functions:
        raise ValidationError(f"tool_choice={json.dumps(choice)} needs tools")
    rendered = [{"type": "function", "function": f} for f in functions]
    names = frozenset(f["name"] for f in functions)
    if choice == "auto":
        return ToolPlan(rendered, None, names, one)
    _check_parameters(functions)
    if choice == "required":
        return ToolPlan(rendered, _calls_grammar(fmt, functions, parallel), names, one)
    name = _named(choice)
    if name not in names:
        listed = ", ".join(sorted(names))
        raise ValidationError(
            f"tool_choice.function.name={name!r} is not one of the tools ({listed})"
        )
    chosen = [f for f in functions if f["name"] == name]
    # OpenAI's forced function is exactly one call of it, whatever parallel_tool_calls says
    return ToolPlan(rendered, _calls_grammar(fmt, chosen, False), names, 1)


def _named(choice: Any) -> str:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return str(function["name"])
    raise ValidationError(
        f"tool_choice={json.dumps(choice)[:80]} must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}'
    )


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise ValidationError(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
        ):
            raise ValidationError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValidationError(
                f"tools[{i}].function.name={str(name)[:70]!r} must be 1-64 letters, digits, _ or -"
            )
        if any(f["name"] == name for f in out):
            raise ValidationError(f"tools[{i}].function.name={name!r} is listed twice")
        parameters = function.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise ValidationError(f"tools[{i}].function.parameters must be a JSON schema object")
        kept = {"name": name, "parameters": parameters}
        if isinstance(function.get("description"), str):
            kept = {"name": name, "description": function["description"], "parameters": parameters}
        out.append(kept)
    return out


def _check_parameters(functions: list[dict[str, Any]]) -> None:
    """Each function's parameters compiled as a schema of their own before the calls grammar
    holds them, so that a bad one is named as the client wrote it (functions[i] is tools[i])."""
    for i, function in enumerate(functions):
        schema = StructuredOutput(json_schema=json.dumps(function["parameters"]))
        try:
            check_structured_output(schema, "", f"tools[{i}].function.parameters")
        except ConstraintError as err:
            raise ValidationError(str(err)) from err


def _calls_grammar(
    fmt: ToolFormat, functions: list[dict[str, Any]], parallel: bool
) -> StructuredOutput:
    """A Lark grammar (llguidance's, with %json for the call objects): one call, or with
    parallel_tool_calls one or more, each of one of functions with arguments that validate,
    written in the model's format."""
    return StructuredOutput(grammar=fmt.calls_grammar(functions, parallel))


def read_answer(plan: ToolPlan, fmt: ToolFormat, text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) of a whole answer under plan: at most plan.max_calls calls, and no call
    markup in the content."""
    content, calls = fmt.parse(text, set(plan.names))
    return _content(plan, fmt, content), calls[: plan.max_calls]


def _content(plan: ToolPlan, fmt: ToolFormat, text: str) -> str:
    return "" if plan.constraint is not None else fmt.strip_markup(text)


@dataclass
class AnswerStream:
    """One streamed choice read under plan: the same content and calls as read_answer gives for
    the whole text, sent as they are known (fmt.stream holds back what may be a call)."""

    plan: ToolPlan
    fmt: ToolFormat
    num_calls: int = 0  # calls sent
    _stream: Any = field(init=False)

    def __post_init__(self) -> None:
        self._stream = self.fmt.stream(set(self.plan.names))

    def add(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send, calls to send) after text; last: the answer ends with it."""
        out, calls = self._stream.add(text)
        if last:
            rest, more = self._stream.finish()
            out, calls = out + rest, calls + more
        if self.plan.max_calls is not None:
            calls = calls[: max(self.plan.max_calls - self.num_calls, 0)]
        self.num_calls += len(calls)
        return _content(self.plan, self.fmt, out), calls
