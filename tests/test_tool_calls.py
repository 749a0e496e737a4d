"""Tool calling's text side, without a model: the Hermes fallback's prompt, reading calls back
from whole answers and from streamed pieces split anywhere, and tool_choice's checks."""

from __future__ import annotations

import json

import pytest

from common.structured_output import check_structured_output
from gateway.openai_protocol import ChatCompletionRequest, chat_request
from gateway.openai_tools import tool_plan
from gateway.tool_prompt import CallStream, ChatTurn, fallback_turns, parse_tool_calls
from gateway.validation import ValidationError

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = {"get_weather", "get_time"}
ANSWER = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_parse_whole_answer() -> None:
    content, calls = parse_tool_calls(ANSWER, NAMES)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert len({c["id"] for c in calls}) == 2
    # an unknown name or bad JSON stays text
    text = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, NAMES) == (text, [])
    assert parse_tool_calls("<tool_call>{oops</tool_call>", NAMES)[1] == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 1000])
def test_streamed_pieces_give_the_same_calls(size: int) -> None:
    stream = CallStream(NAMES)
    text, calls = "", []
    for i in range(0, len(ANSWER), size):
        piece, done = stream.add(ANSWER[i : i + size])
        assert "<tool" not in piece and "{" not in piece  # nothing of a call streams as text
        text += piece
        calls += done
    text += stream.finish()
    whole_content, whole_calls = parse_tool_calls(ANSWER, NAMES)
    assert text.strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_stream_releases_text_that_is_not_a_call() -> None:
    stream = CallStream(NAMES)
    assert stream.add("a <tool") == ("a ", [])
    assert stream.add("box> b") == ("<toolbox> b", [])
    assert stream.add("<tool_call>never closed") == ("", [])
    assert stream.finish() == "<tool_call>never closed"


def test_fallback_prompt_carries_tools_calls_and_results() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    turns = [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "Weather in Oslo?"),
        ChatTurn("assistant", "", [call]),
        ChatTurn("tool", '{"temp": 3}', tool_call_id="c1"),
    ]
    out = fallback_turns(turns, [WEATHER])
    assert [t.role for t in out] == ["system", "user", "assistant", "user"]
    assert out[0].content.startswith("Be brief.") and '"get_weather"' in out[0].content
    assert parse_tool_calls(out[2].content, NAMES)[1][0]["function"]["name"] == "get_weather"
    assert out[3].content == '<tool_response>\n{"temp": 3}\n</tool_response>'


def test_tool_choice_plans() -> None:
    assert tool_plan([WEATHER], "none", True).tools == []
    auto = tool_plan([WEATHER, TIME], None, True)
    assert auto.constraint is None and auto.names == NAMES
    named = tool_plan(
        [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False
    )
    assert named.constraint is not None and "get_weather" not in named.constraint.grammar
    check_structured_output(named.constraint, "")  # compiles
    required = tool_plan([WEATHER, TIME], "required", True)
    assert required.constraint is not None
    check_structured_output(required.constraint, "")


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "'nope' is not one of"),
        ([WEATHER], "sometimes", "must be 'none', 'auto', 'required'"),
        ([], "required", "needs tools"),
        ([{"type": "function", "function": {"name": "a b"}}], "auto", "tools[0].function.name"),
        ([WEATHER, WEATHER], "auto", "listed twice"),
    ],
)
def test_bad_tools_refused(tools: list, choice: object, message: str) -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice=choice
    )
    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("(", r"\(")):
        chat_request(body)
