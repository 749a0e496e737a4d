"""The OpenAI Responses API's request (POST /v1/responses) as a chat completion request, so that
it takes the chat path whole: template, tools, tool_choice, grammar, validation.

    input (text or items)        -> messages: the previous response's conversation first
    instructions                 -> a system message first (not carried to a later response)
    message items                -> messages (input_text / output_text parts; other kinds 400)
    function_call items          -> an assistant message's tool_calls (consecutive ones merge)
    function_call_output items   -> tool messages (tool_call_id: the call_id)
    reasoning items              -> dropped (the template is not shown a model's thinking)
    tools [{type: function, ...}]-> chat tools; other tool types 400
    tool_choice {type, name}     -> {type: function, function: {name}}
    text.format json_schema      -> response_format json_schema
    max_output_tokens            -> max_tokens

Neighbours: gateway/responses_format.py renders the answer, gateway/responses_store.py keeps
stored responses for previous_response_id.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from llmserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    NullIsDefault,
)
from llmserve.gateway.validation import ValidationError

# The chat API's field names in errors, as the Responses API names them (http_errors.py).
RENAMES = (
    (r"response_format\.json_schema\.", "text.format."),
    (r"response_format", "text.format"),
    (r"max_tokens", "max_output_tokens"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"messages", "input"),
)
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(NullIsDefault):
    """POST /v1/responses. Fields OpenAI has and this server ignores are listed in docs/api.md
    (metadata, include, truncation, prompt_cache_key, service_tier, ...); of `reasoning`, only
    its effort is read (the template's reasoning_effort)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Beyond OpenAI's, as the chat API takes them (vLLM accepts them here too).
    seed: int | None = None
    top_k: int | None = Field(None, ge=-(2**31), le=2**31 - 1)
    min_p: float | None = None
    stop: str | list[str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # its effort is the chat API's reasoning_effort
    # OpenAI's, refused: state this server does not keep (a 400 names them)
    background: bool = False
    conversation: Any = None
    prompt: Any = None


def chat_body(body: ResponsesRequest, history: list[ChatMessageParam]) -> ChatCompletionRequest:
    """The chat completion request body stands for; history: the conversation of its
    previous_response_id (none without). Raises ValidationError naming body's fields."""
    if body.background:
        raise ValidationError("background=true is not supported: send the request and wait")
    if body.conversation is not None:
        raise ValidationError("conversation is not supported; continue with previous_response_id")
    if body.prompt is not None:
        raise ValidationError("prompt (a stored prompt template) is not supported; send input")
    messages = list(history)
    if body.instructions:
        messages.insert(0, ChatMessageParam(role="system", content=body.instructions))
    messages += input_messages(body.input)
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        stream=body.stream,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        user=body.user,
        seed=body.seed,
        top_k=body.top_k,
        min_p=body.min_p,
        stop=body.stop,
        chat_template_kwargs=body.chat_template_kwargs,
        reasoning_effort=(body.reasoning or {}).get("effort"),
    )


def input_messages(items: str | list[dict[str, Any]]) -> list[ChatMessageParam]:
    """The chat messages of a Responses input: text is one user message."""
    if isinstance(items, str):
        return [ChatMessageParam(role="user", content=items)]
    out: list[ChatMessageParam] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":
            call = _call(i, item)
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls:
                last.tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                out.append(ChatMessageParam(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", f"input[{i}]")
            output = item.get("output")
            text = output if isinstance(output, str) else _parts_text(f"input[{i}].output", output)
            out.append(ChatMessageParam(role="tool", content=text, tool_call_id=call_id))
        elif kind != "reasoning":
            raise ValidationError(
                f"input[{i}].type={str(kind)[:40]!r} is not supported (only message, "
                "function_call, function_call_output and reasoning items)"
            )
    return out


def _message(i: int, item: dict[str, Any]) -> ChatMessageParam:
    role = item.get("role")
    if role not in _ROLES:
        raise ValidationError(f"input[{i}].role={str(role)[:40]!r} must be one of {_ROLES}")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(f"input[{i}].content", content)
    return ChatMessageParam(role=role, content=text)


def _parts_text(where: str, parts: Any) -> str:
    """The text of a list of content parts; a part that is not text is refused."""
    if not isinstance(parts, list):
        raise ValidationError(f"{where} must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ValidationError(
                f"{where}[{j}].type={str(kind)[:40]!r} is not supported (only input_text and "
                "output_text parts)"
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{where}.{key} must be a non-empty string")
    return value


def _call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    """A function_call item as the chat API's tool call."""
    where = f"input[{i}]"
    arguments = item.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise ValidationError(f"{where}.arguments must be a string (the arguments' JSON text)")
    return {
        "id": _string(item, "call_id", where),
        "type": "function",
        "function": {"name": _string(item, "name", where), "arguments": arguments},
    }


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({type, name, description, parameters, strict}) as chat tools."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValidationError(
                f"tools[{i}].type={str(kind)[:40]!r} is not supported (only function tools)"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValidationError(
        f"tool_choice={json.dumps(choice)[:80]} must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}'
    )


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat API's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValidationError("text.format must be an object with a type")
    if fmt.get("type") != "json_schema":
        return fmt  # text and json_object read the same; others are refused as response_format
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}
