"""Reasoning output (gateway/reasoning.py): the splitter itself, then one echo stack whose chat
template opens a thinking block in its generation prompt, as DeepSeek-R1's and Qwen3's thinking
templates do, driven with the openai SDK. The echo engine answers the first message's text, so
USER_THINKS makes "the model" think "plan" and answer "answer".
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from llmserve.bench.byte_tokenizer import write_byte_tokenizer
from llmserve.gateway.reasoning import ReasoningStream, parser_enabled
from tests.stack import Stack, start_echo_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)
USER_THINKS = [{"role": "user", "content": "plan</think>\n\nanswer"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


# -- the splitter -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("inside", "text", "split"),
    [
        (True, "plan</think>\n\nanswer", ("plan", "answer")),
        (False, "<think>\nhm</think>\n\nok", ("hm", "ok")),
        (False, "no thinking", ("", "no thinking")),
        (True, "cut off mid-thought", ("cut off mid-thought", "")),
        # one thinking block: a later tag is content
        (False, "<think>a</think>b<think>c</think>", ("a", "b<think>c</think>")),
        (False, "a < b </think", ("", "a < b </think")),
    ],
)
def test_split_whole_and_streamed(inside: bool, text: str, split: tuple[str, str]) -> None:
    assert ReasoningStream(inside).split(text) == split
    stream = ReasoningStream(inside)  # one character at a time: tags split across pieces
    pieces = [stream.add(c) for c in text] + [stream.finish()]
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == split
    assert stream.reasoning_text == split[0]


def test_parser_picked_from_the_template() -> None:
    assert parser_enabled("auto", THINKING_TEMPLATE)
    assert not parser_enabled("auto", "{{ messages }}") and not parser_enabled("auto", None)
    assert not parser_enabled("none", THINKING_TEMPLATE)
    assert parser_enabled("qwen3", "{{ messages }}")  # named: whatever the template


# -- through the server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = tmp_path_factory.mktemp("thinking-tokenizer")
    write_byte_tokenizer(model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "config.json").write_text("{}")
    s = start_echo_stack(model, tmp_path_factory.mktemp("logs"), http=True)
    yield s
    s.close()


def sdk(stack: Stack) -> openai.OpenAI:
    assert stack.http_url is not None
    return openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0)


def test_chat_reasoning_content_whole_and_streamed(stack: Stack) -> None:
    client = sdk(stack)
    whole = client.chat.completions.create(model="fake-echo", messages=USER_THINKS)  # type: ignore[arg-type]
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("user\nplan", "answer")  # type: ignore[attr-defined]
    chunks = list(
        client.chat.completions.create(model="fake-echo", messages=USER_THINKS, stream=True)  # type: ignore[arg-type]
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (reasoning, "".join(d.content or "" for d in deltas)) == ("user\nplan", "answer")


def test_enable_thinking_false_reaches_the_template(stack: Stack) -> None:
    """chat_template_kwargs closes the thinking in the prompt: nothing is reasoning then."""
    whole = sdk(stack).chat.completions.create(
        model="fake-echo",
        messages=USER_THINKS,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = whole.choices[0].message
    assert message.reasoning_content is None  # type: ignore[attr-defined]
    assert message.content == "user\nplan</think>\n\nanswer"


def test_tool_call_after_the_thinking(stack: Stack) -> None:
    # The system message comes first (the tools' listing follows it there): its echo thinks,
    # then calls.
    messages = [{"role": "system", "content": f"plan</think>{CALL}"}, *USER_THINKS]
    whole = sdk(stack).chat.completions.create(
        model="fake-echo",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
    )
    message = whole.choices[0].message
    assert message.reasoning_content == "system\nplan"  # type: ignore[attr-defined]
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]  # type: ignore[union-attr]
    assert calls == [("get_weather", '{"city": "Oslo"}')]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert "<tool_call>{" not in (message.content or "")


def test_responses_reasoning_item(stack: Stack) -> None:
    client = sdk(stack)
    whole = client.responses.create(model="fake-echo", input=USER_THINKS, store=False)  # type: ignore[arg-type]
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "user\nplan"  # type: ignore[union-attr,index]
    assert whole.output_text == "answer"
    # one token per byte: the thinking's 9 tokens (its tags not counted)
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens == 9
    events = list(
        client.responses.create(model="fake-echo", input=USER_THINKS, stream=True, store=False)  # type: ignore[arg-type]
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("user\nplan", "answer")
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")


def test_anthropic_thinking_blocks(stack: Stack) -> None:
    """The Messages API's thinking block comes first, whole and streamed (thinking_delta)."""
    anthropic = pytest.importorskip("anthropic")
    assert stack.http_url is not None
    client = anthropic.Anthropic(
        base_url=stack.http_url.removesuffix("/v1"), api_key="none", max_retries=0
    )
    fields = {"model": "fake-echo", "max_tokens": 64, "messages": USER_THINKS}
    message = client.messages.create(**fields)
    blocks = [(b.type, b.thinking if b.type == "thinking" else b.text) for b in message.content]
    assert blocks == [("thinking", "user\nplan"), ("text", "answer")]
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "user\nplan" and final.content[1].text == "answer"


def test_reasoning_parser_flag_is_checked() -> None:
    from llmserve.gateway.config import GatewayConfig

    assert GatewayConfig(reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    with pytest.raises(ValueError, match="reasoning_parser='r2'"):
        GatewayConfig(reasoning_parser="r2")
