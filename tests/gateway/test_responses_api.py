"""The Responses API's parts that need no server: input items as chat messages, and the bounded
store of responses (the HTTP flows are in tests/gateway/test_clients.py, through the openai SDK)."""

from __future__ import annotations

import pytest

from llmserve.gateway.openai_protocol import ChatMessageParam
from llmserve.gateway.responses_request import ResponsesRequest, chat_body, input_messages
from llmserve.gateway.responses_store import ResponseStore, StoredResponse
from llmserve.gateway.validation import ValidationError


def test_input_items_become_chat_messages() -> None:
    """Parallel calls merge into one assistant turn; outputs are tool messages by call_id;
    reasoning items are dropped; content parts join."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": t} for t in "ab"]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    messages = input_messages(items)
    assert [(m.role, m.content) for m in messages] == [
        ("user", "ab"), ("assistant", None), ("tool", "one"), ("tool", "two"),
    ]  # fmt: skip
    assert [c["id"] for c in messages[1].tool_calls or []] == ["c1", "c2"]
    assert [m.tool_call_id for m in messages[2:]] == ["c1", "c2"]


def test_instructions_history_and_tools() -> None:
    history = [ChatMessageParam(role="user", content="before")]
    body = ResponsesRequest(
        input="now",
        instructions="be brief",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        max_output_tokens=7,
    )
    chat = chat_body(body, history)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "be brief"), ("user", "before"), ("user", "now"),
    ]  # fmt: skip
    assert chat.tools == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}},
    }
    assert chat.max_tokens == 7


@pytest.mark.parametrize(
    ("items", "names"),
    [
        ([{"type": "item_reference", "id": "x"}], "input[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        (
            [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}],
            "input[0].arguments",
        ),
    ],
)
def test_bad_items_are_named(items: list[dict[str, object]], names: str) -> None:
    with pytest.raises(ValidationError) as err:
        input_messages(items)  # type: ignore[arg-type]
    assert str(err.value).startswith(names)


def stored(text: str) -> StoredResponse:
    return StoredResponse(text, [ChatMessageParam(role="user", content=text)])


def test_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    store.put("a", stored("1"))
    store.put("b", stored("2"))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", stored("3"))
    assert sorted(store.responses) == ["a", "c"]
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == stored("3").num_bytes


def test_store_bounded_by_bytes_and_off_at_zero() -> None:
    one = stored("x" * 100)
    store = ResponseStore(max_responses=100, max_bytes=one.num_bytes * 2)
    for key in "abc":
        store.put(key, stored("x" * 100))
    assert list(store.responses) == ["b", "c"] and store.num_bytes <= store.max_bytes
    store.put("huge", stored("x" * 1000))  # larger than the whole store: not kept
    assert "huge" not in store.responses
    off = ResponseStore(max_responses=0)
    off.put("a", one)
    assert off.get("a") is None


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"background": True}, "background=true"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_server_state_it_does_not_keep_is_refused(fields: dict[str, object], names: str) -> None:
    with pytest.raises(ValidationError) as err:
        chat_body(ResponsesRequest(input="x", **fields), [])  # type: ignore[arg-type]
    assert str(err.value).startswith(names)
