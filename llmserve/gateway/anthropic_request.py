"""Anthropic's Messages API request (POST /v1/messages) as a chat completion request, so it takes
the chat path whole (template, tools, grammar, validation), and its error shape.

    system (text or text blocks)   -> a system message first
    text blocks                    -> the message's text
    tool_use blocks (assistant)    -> tool_calls (id, name, input as the arguments' JSON)
    tool_result blocks (user)      -> tool messages, before the rest of that user turn
    thinking blocks                -> dropped (the template is not shown earlier thinking)
    tools [{name, input_schema}]   -> chat tools; tool_choice auto/any/tool/none -> auto,
                                      required, the named function, none
    disable_parallel_tool_use      -> parallel_tool_calls false
    thinking {type: enabled/disabled} -> chat_template_kwargs enable_thinking

Neighbours: gateway/anthropic_format.py renders the answer; gateway/anthropic_routes.py.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, Field

from llmserve.gateway.openai_protocol import ChatCompletionRequest, ChatMessageParam
from llmserve.gateway.validation import ValidationError

# The chat API's field names in errors, as the Messages API names them.
RENAMES = (
    (r"stop\b", "stop_sequences"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"tool_choice=\"required\"", 'tool_choice={"type": "any"}'),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
)
# HTTP status -> Anthropic's error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    kind = ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesRequest(BaseModel):
    """POST /v1/messages (and, without max_tokens, /v1/messages/count_tokens). Fields this
    server ignores: metadata (its user_id names the tenant), service_tier, container."""

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def chat_body(body: MessagesRequest, need_max_tokens: bool = True) -> ChatCompletionRequest:
    """The chat completion request body stands for. Raises ValidationError naming its fields."""
    if need_max_tokens and body.max_tokens is None:
        raise ValidationError("max_tokens is required")
    messages = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else _blocks_text("system", system)
        messages.append(ChatMessageParam(role="system", content=text))
    for i, message in enumerate(body.messages):
        messages += _messages(i, message)
    choice, parallel = _tool_choice(body.tool_choice)
    user = (body.metadata or {}).get("user_id")
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        stream=body.stream,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k if body.top_k != -1 else None,
        tools=_tools(body.tools),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        user=user if isinstance(user, str) else None,
        chat_template_kwargs=_thinking(body.thinking),
    )


def _messages(i: int, message: dict[str, Any]) -> list[ChatMessageParam]:
    """One Anthropic message as chat messages (a user turn's tool results come first)."""
    where = f"messages[{i}]"
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise ValidationError(f"{where}.role={str(role)[:40]!r} must be 'user' or 'assistant'")
    content = message.get("content")
    if isinstance(content, str):
        return [ChatMessageParam(role=role, content=content)]
    if not isinstance(content, list):
        raise ValidationError(f"{where}.content must be a string or a list of content blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_call(at, block))
        elif kind == "tool_result" and role == "user":
            results.append(_result(at, block))
        elif kind not in ("thinking", "redacted_thinking"):
            raise ValidationError(
                f"{at}.type={str(kind)[:40]!r} is not supported in a {role} message (text, "
                "tool_use (assistant), tool_result (user) and thinking blocks are)"
            )
    turn = ChatMessageParam(role=role, content="".join(texts), tool_calls=calls or None)
    return results + ([turn] if texts or calls or not results else [])


def _call(at: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise ValidationError(f"{at} must have a string id and name")
    if not isinstance(arguments, dict):
        raise ValidationError(f"{at}.input must be an object")
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": call_id, "type": "function", "function": function}


def _result(at: str, block: dict[str, Any]) -> ChatMessageParam:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise ValidationError(f"{at}.tool_use_id must be a string")
    content = block.get("content", "")
    text = content if isinstance(content, str) else _blocks_text(f"{at}.content", content)
    if block.get("is_error"):
        text = f"Error: {text}"
    return ChatMessageParam(role="tool", content=text, tool_call_id=call_id)


def _blocks_text(where: str, blocks: Any) -> str:
    if not isinstance(blocks, list):
        raise ValidationError(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not (isinstance(block, dict) and block.get("type") == "text"):
            kind = block.get("type") if isinstance(block, dict) else None
            raise ValidationError(f"{where}[{j}].type={str(kind)[:40]!r} is not supported (text)")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom") if isinstance(tool, dict) else None
        if kind != "custom":
            raise ValidationError(
                f"tools[{i}].type={str(kind)[:40]!r} is not supported (only custom tools, with an "
                "input_schema)"
            )
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema", {})}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """(the chat tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValidationError(
        f"tool_choice={json.dumps(choice)[:80]} must be of type auto, any, none, or tool with "
        "a name"
    )


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise ValidationError(f"thinking.type={str(kind)[:40]!r} must be enabled or disabled")
    return {"enable_thinking": kind != "disabled"}
