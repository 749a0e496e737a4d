"""gpt-oss's harmony format (gateway/harmony.py): the parser on harmony text (whole = streamed
in random pieces), calls read back and forced by a grammar, a rendered conversation read back
(our own transcription of the documented format, and gpt-oss's own template when a local copy
is named by GPT_OSS_CHAT_TEMPLATE), then one echo stack whose template writes harmony, driven
with the openai SDK (and the Messages API as raw JSON). The echo engine answers its prompt
from the start, so a user message that closes itself and writes the assistant's messages makes
"the model" write them: the system, developer and user messages it echoes first are other
roles', dropped.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from llguidance import LLMatcher, LLTokenizer

from llmserve.bench.byte_tokenizer import write_byte_tokenizer
from llmserve.common.structured_output import check_structured_output
from llmserve.common.tokenizer_files import load_tokenizer_files
from llmserve.gateway.detokenizer import IncrementalDetokenizer
from llmserve.gateway.harmony import HarmonyStream, harmony_request, read_calls
from llmserve.gateway.openai_protocol import ChatCompletionRequest, chat_request
from llmserve.gateway.openai_tools import AnswerStream, read_answer, tool_plan
from llmserve.gateway.reasoning import parser_enabled, speaks_harmony
from llmserve.gateway.tokenizer import Tokenizer, _compile_template
from llmserve.gateway.tool_formats import HarmonyFormat, tool_format_of
from llmserve.gateway.tool_prompt import ChatTurn
from llmserve.gateway.validation import ValidationError, ValidRequest
from llmserve.protos import scheduler_pb2
from tests.stack import Stack, start_echo_stack

pytestmark = pytest.mark.stack  # the last tests start service processes (tests/conftest.py)

# <|return|> third: the echo engine's EOS is id 258, as gpt-oss's config.json names <|return|>
SPECIALS = ["<|endoftext|>", "<|call|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>", "<|constrain|>"]  # fmt: skip
CALL_ID, RETURN_ID, CHANNEL_ID = 257, 258, 262

# Our transcription of harmony as OpenAI documents it (not gpt-oss's file, which is not ours to
# copy): the system message with the reasoning effort, the developer message with the
# instructions and the tools as a TypeScript namespace, tool calls in the commentary channel,
# tool results from functions.NAME to the assistant.
HARMONY_TEMPLATE = """
{%- set ns = namespace(call='') -%}
{{- '<|start|>system<|message|>You are a test model.\nReasoning: ' -}}
{{- reasoning_effort | default('medium') -}}
{{- '\n\n# Valid channels: analysis, commentary, final. Channel must be included for every '
    'message.' -}}
{%- if tools -%}
{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- set rest = messages -%}
{%- if messages and messages[0].role in ['system', 'developer'] -%}
{%- set rest = messages[1:] -%}
{%- endif -%}
{%- if tools or rest | length < messages | length -%}
{{- '<|start|>developer<|message|>' -}}
{%- if rest | length < messages | length -%}
{{- '# Instructions\n\n' + messages[0].content -}}
{%- if tools %}{{ '\n\n' }}{% endif -%}
{%- endif -%}
{%- if tools -%}
{{- '# Tools\n\n## functions\n\nnamespace functions {\n\n' -}}
{%- for tool in tools -%}
{{- '// ' + tool.function.description + '\n' if tool.function.description -}}
{{- 'type ' + tool.function.name + ' = (_: {\n' -}}
{%- for key, spec in tool.function.parameters.get('properties', {}).items() -%}
{{- key + ': ' + ('number' if spec.type in ['number', 'integer'] else spec.type) + ',\n' -}}
{%- endfor -%}
{{- '}) => any;\n\n' -}}
{%- endfor -%}
{{- '} // namespace functions' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- endif -%}
{%- for m in rest -%}
{%- if m.role == 'user' -%}
{{- '<|start|>user<|message|>' + m.content + '<|end|>' -}}
{%- elif m.role == 'assistant' -%}
{%- if m.thinking -%}
{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}
{%- endif -%}
{%- if m.tool_calls -%}
{%- set call = m.tool_calls[0].function -%}
{%- set ns.call = call.name -%}
{{- '<|start|>assistant<|channel|>commentary to=functions.' + call.name -}}
{{- ' <|constrain|>json<|message|>' + call.arguments | tojson + '<|call|>' -}}
{%- else -%}
{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{{- '<|start|>functions.' + ns.call + ' to=assistant<|channel|>commentary<|message|>' -}}
{{- m.content + '<|end|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif -%}
"""

CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'  # noqa: E501
TEXTS = {  # harmony answer -> (reasoning, content: a call's as its canonical markup)
    "final": ("<|channel|>analysis<|message|>plan it<|end|><|start|>assistant<|channel|>"
              "final<|message|>the <b>answer</b> < 3<|return|>",
              ("plan it", "the <b>answer</b> < 3")),
    "call": ('<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>'
             'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
             "<|call|>", ("need weather", CALL)),
    # the recipient after the role, and no <|constrain|>: as gpt-oss also writes it
    "role recipient": ('<|channel|>analysis<|message|>a<|end|><|start|>assistant to=functions.'
                       'get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>',
                       ("a", CALL)),
    "preamble": ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
                 "final<|message|>Done.<|return|>", ("", "Checking.Done.")),
    "two thoughts": ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>"
                     "analysis<|message|>b<|end|>", ("ab", "")),
    "built-in tool": ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>"
                      'analysis to=browser.search code<|message|>{"q": 1}<|call|>', ("x", "")),
    "other roles": ("<|start|>system<|message|>sys<|end|><|start|>user<|message|>hi<|end|>"
                    "<|start|>assistant<|channel|>final<|message|>ok<|return|>", ("", "ok")),
    "cut in thought": ("<|channel|>analysis<|message|>thinking <|en", ("thinking <|en", "")),
    "not harmony": ("plain text", ("", "plain text")),
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def split_randomly(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


# -- the parser ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TEXTS))
def test_split_whole_and_streamed_in_random_pieces(name: str) -> None:
    text, split = TEXTS[name]
    assert HarmonyStream().split(text) == split
    for pieces in [list(text), *(split_randomly(text, seed) for seed in range(20))]:
        stream = HarmonyStream()
        out = [stream.add(p) for p in pieces] + [stream.finish()]
        assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == split, pieces
        assert stream.reasoning_text == split[0]


def test_thinking_streams_before_the_message_ends() -> None:
    stream = HarmonyStream()
    assert stream.add("<|channel|>analysis<|message|>step one, ") == ("step one, ", "")
    assert stream.add("two<|e") == ("two", "")  # a tag's prefix is held
    assert stream.add("nd|><|start|>assistant<|channel|>final<|message|>Hi") == ("", "Hi")


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("name", ["call", "role recipient", "preamble", "final"])
def test_calls_streamed_equal_the_whole_answer(name: str, size: int) -> None:
    """Through the chat layer as ChatFormat runs it: reasoning split first, then the content
    read for calls (whole, and streamed in pieces of size)."""
    fmt = HarmonyFormat()
    plan = tool_plan([WEATHER], "auto", True, fmt)
    text = TEXTS[name][0]
    _, content = HarmonyStream().split(text)
    whole_content, whole_calls = read_answer(plan, fmt, content)
    stream, answer = HarmonyStream(), AnswerStream(plan, fmt)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    streamed_content, streamed_calls = "", []
    for i, piece in enumerate(pieces):
        _, piece_content = stream.add(piece)
        if i == len(pieces) - 1:
            piece_content += stream.finish()[1]
        out, calls = answer.add(piece_content, last=i == len(pieces) - 1)
        streamed_content, streamed_calls = streamed_content + out, streamed_calls + calls
    assert streamed_content == whole_content and "<|" not in whole_content
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in whole_calls]
    if "call" in name or "recipient" in name:
        assert [c["function"] for c in whole_calls] == [
            {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        ]
        assert whole_calls[0]["id"].startswith("call_") and whole_content == ""


def test_calls_without_tools_are_dropped() -> None:
    assert HarmonyStream(keep_calls=False).split(TEXTS["call"][0]) == ("need weather", "")


def test_calls_that_do_not_parse_are_dropped_not_shown() -> None:
    fmt = HarmonyFormat()
    plan = tool_plan([WEATHER], "auto", True, fmt)
    for text in [CALL.replace("get_weather", "get_time"), CALL.replace('"Oslo"}', '"Os')]:
        content, calls = read_answer(plan, fmt, text)
        assert (content, calls) == ("", [])


def test_parser_and_format_picked_from_the_template() -> None:
    assert parser_enabled("auto", HARMONY_TEMPLATE) and speaks_harmony("auto", HARMONY_TEMPLATE)
    assert not speaks_harmony("none", HARMONY_TEMPLATE) and not speaks_harmony("auto", None)
    assert speaks_harmony("harmony", "{{ messages }}")  # named: whatever the template
    assert not speaks_harmony("think", HARMONY_TEMPLATE)
    assert tool_format_of(HARMONY_TEMPLATE).name == "harmony"


def harmony_tokenizer(tmp_path: Path) -> Tokenizer:
    write_byte_tokenizer(tmp_path, SPECIALS, HARMONY_TEMPLATE, "<|return|>")
    return Tokenizer.from_files(load_tokenizer_files(tmp_path))


def matches(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for grammar accepts text whole (EOS: <|return|>)."""
    hf = tokenizer.tokenizer
    vocab = LLTokenizer(hf.to_str(), n_vocab=hf.get_vocab_size(), eos_token=RETURN_ID)
    matcher = LLMatcher(vocab, LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids = hf.encode(text, add_special_tokens=False).ids
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and matcher.is_accepting()
    )


THINKS = "<|channel|>analysis<|message|>{x} < y\n<|end|><|start|>assistant"


def test_required_grammar_writes_one_call_in_special_tokens(tmp_path: Path) -> None:
    """tool_choice required: one analysis message or none, then one call, its tags the special
    tokens (by id); the <|call|> after it is the model's (an EOS, stopped on)."""
    tokenizer = harmony_tokenizer(tmp_path)
    fmt = tokenizer.tool_format
    constraint = tool_plan([WEATHER], "required", True, fmt).constraint
    assert constraint is not None and f"<[{CHANNEL_ID}]>" in constraint.grammar
    check_structured_output(constraint, "")
    forced = CALL.removeprefix("<|start|>assistant").removesuffix("<|call|>")
    assert matches(tokenizer, constraint.grammar, forced)
    assert matches(tokenizer, constraint.grammar, THINKS + forced)
    assert not matches(tokenizer, constraint.grammar, forced.replace('"Oslo"', "3"))
    assert not matches(tokenizer, constraint.grammar, "<|channel|>final<|message|>hi")
    assert fmt.parse(forced, {"get_weather"})[1][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("constraint", "answer", "not_answer"),
    [
        ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
          "required": ["a"]})}, '{"a": 1}', '{"a": "1"}'),
        ({"json_object": True}, '{"b": [1, 2]}', "[1]"),
        ({"regex": "[0-9]+/[0-9]+"}, "3/4", "3/x"),
        ({"choice": {"choices": ["yes", "no"]}}, "no", "maybe"),
    ],
)  # fmt: skip
def test_response_format_applies_to_the_final_message(
    tmp_path: Path, constraint: dict[str, Any], answer: str, not_answer: str
) -> None:
    tokenizer = harmony_tokenizer(tmp_path)
    submit = scheduler_pb2.SubmitRequest(sampling={"structured_output": constraint})
    valid = harmony_request(ValidRequest(submit, []), tokenizer.tokenizer.token_to_id)
    so = valid.sampling.structured_output
    assert so.WhichOneof("constraint") == "grammar"
    check_structured_output(so, "")
    final = "<|channel|>final<|message|>"
    assert matches(tokenizer, so.grammar, final + answer)
    assert matches(tokenizer, so.grammar, THINKS + final + answer)
    assert not matches(tokenizer, so.grammar, final + not_answer)
    assert not matches(tokenizer, so.grammar, answer)  # in the final channel only
    assert HarmonyStream().split(THINKS + final + answer) == ("{x} < y\n", answer)


# -- rendering: the template's text read back ---------------------------------------------------


def templates() -> list[Any]:
    official = os.environ.get("GPT_OSS_CHAT_TEMPLATE")
    return [
        pytest.param(HARMONY_TEMPLATE, id="transcribed"),
        pytest.param(
            Path(official).read_text() if official else "",
            id="gpt-oss",
            marks=pytest.mark.skipif(
                not official, reason="GPT_OSS_CHAT_TEMPLATE names no local gpt-oss template"
            ),
        ),
    ]


@pytest.mark.parametrize("template", templates())
def test_rendered_assistant_turns_read_back(template: str) -> None:
    """The assistant's turn the template writes after the generation prompt parses back into
    the thinking, content and call it was given."""
    render = _compile_template(template).render
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}  # fmt: skip
    user = {"role": "user", "content": "Weather in Oslo?"}
    for turn, expected in [
        ({"role": "assistant", "thinking": "easy", "content": "Sunny."}, ("easy", "Sunny.")),
        ({"role": "assistant", "thinking": "need it", "content": "", "tool_calls": [call]},
         ("need it", CALL)),
    ]:  # fmt: skip
        kwargs = {"tools": [WEATHER], "strftime_now": lambda _: "2026-12-05"}
        prompt = render(messages=[user], add_generation_prompt=True, **kwargs)
        whole = render(messages=[user, turn], add_generation_prompt=False, **kwargs)
        assert whole.startswith(prompt)
        assert HarmonyStream().split(whole[len(prompt) :]) == expected


def test_reasoning_effort_is_a_template_variable() -> None:
    messages: list[Any] = [{"role": "user", "content": "?"}]
    req = chat_request(ChatCompletionRequest(messages=messages, reasoning_effort="high"))  # type: ignore[call-arg]
    assert json.loads(req.chat.template_kwargs_json) == {"reasoning_effort": "high"}
    with pytest.raises(ValidationError, match="reasoning_effort='minimal' must be one of low"):
        chat_request(ChatCompletionRequest(messages=messages, reasoning_effort="minimal"))  # type: ignore[call-arg]


@pytest.mark.parametrize("template", templates())
def test_effort_tools_calls_and_results_rendered(tmp_path: Path, template: str) -> None:
    """What the gateway gives the template (gateway/tool_prompt.py's messages, the tools,
    reasoning_effort) comes out as harmony: the effort line, the tools' namespace, the
    instructions, the thinking and call of the earlier turn (read back by our parser) and the
    tool's result."""
    write_byte_tokenizer(tmp_path, SPECIALS, template, "<|return|>")
    tokenizer = Tokenizer.from_files(load_tokenizer_files(tmp_path))
    assert tokenizer.tool_format.name == "harmony"
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    turns = [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "?"),
        ChatTurn("assistant", "", [call], reasoning="need it"),
        ChatTurn("tool", "3 C", tool_call_id="c1"),
    ]
    effort = {"reasoning_effort": "high"}
    text = tokenizer.render_chat(turns, tools=[WEATHER], template_kwargs=effort)
    assert "Reasoning: high\n\n# Valid channels" in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n" in text
    assert "namespace functions {\n\n// The weather in a city.\ntype get_weather = (_: {\n" in text
    turn = text.split("<|start|>user<|message|>?<|end|>")[1].split("<|start|>functions.")[0]
    reasoning, content = HarmonyStream().split(turn)
    _, [read] = read_calls(content, {"get_weather"})
    assert (reasoning, read["function"]["arguments"]) == ("need it", '{"city": "Oslo"}')
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>" in text
    assert text.endswith("<|start|>assistant")


def test_harmony_requests_keep_the_markup_and_stop_at_call(tmp_path: Path) -> None:
    tokenizer = harmony_tokenizer(tmp_path)
    submit = scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2], stop_token_ids=[RETURN_ID])
    valid = harmony_request(ValidRequest(submit, []), tokenizer.tokenizer.token_to_id)
    assert not valid.skip_special_tokens
    assert sorted(valid.submit.stop_token_ids) == [CALL_ID, RETURN_ID]
    ids = tokenizer.encode("<|channel|>final<|message|>hi<|return|>", add_special_tokens=False)
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    assert "".join(kept.add([i]) for i in ids) == "<|channel|>final<|message|>hi<|return|>"
    skipped = IncrementalDetokenizer(tokenizer, [1])
    assert "".join(skipped.add([i]) for i in ids) == "finalhi"


# -- through the server ---------------------------------------------------------------------------

# The user message closes itself, then "the model" thinks and answers (or calls).
SAYS_FINAL = "<|end|><|start|>assistant<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>answer<|return|>"  # noqa: E501
SAYS_CALL = "<|end|><|start|>assistant<|channel|>analysis<|message|>need it<|end|>" + CALL


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = tmp_path_factory.mktemp("harmony-tokenizer")
    write_byte_tokenizer(model, SPECIALS, HARMONY_TEMPLATE, "<|return|>")
    (model / "config.json").write_text("{}")
    s = start_echo_stack(
        model, tmp_path_factory.mktemp("logs"), "--fake-vocab-size", str(256 + len(SPECIALS)),
        http=True,
    )  # fmt: skip
    yield s
    s.close()


def sdk(stack: Stack) -> openai.OpenAI:
    assert stack.http_url is not None
    return openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0)


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_chat_reasoning_and_content_whole_and_streamed(stack: Stack) -> None:
    client = sdk(stack)
    whole = client.chat.completions.create(model="fake-echo", messages=_user(SAYS_FINAL))
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("plan", "answer")  # type: ignore[attr-defined]
    assert whole.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(
        model="fake-echo", messages=_user(SAYS_FINAL), stream=True
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    assert (reasoning, "".join(d.content or "" for d in deltas)) == ("plan", "answer")


def test_chat_tool_call_whole_and_streamed(stack: Stack) -> None:
    """The answer stops at <|call|> (a stop token the gateway adds: the echo's EOS is
    <|return|>), and the call comes back as OpenAI's."""
    client = sdk(stack)
    fields: dict[str, Any] = {"model": "fake-echo", "messages": _user(SAYS_CALL)}
    fields["tools"] = [WEATHER]
    whole = client.chat.completions.create(**fields)
    message, choice = whole.choices[0].message, whole.choices[0]
    assert choice.finish_reason == "tool_calls" and message.content is None
    assert message.reasoning_content == "need it"  # type: ignore[attr-defined]
    [call] = message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (  # type: ignore[union-attr]
        "get_weather", {"city": "Oslo"},
    )  # fmt: skip
    # no tools asked for: a call is dropped, not shown as content
    bare = client.chat.completions.create(model="fake-echo", messages=_user(SAYS_CALL))
    assert bare.choices[0].message.content in (None, "") and not bare.choices[0].message.tool_calls
    # required: under the calls grammar (the echo engine masks nothing), read the same way
    required = client.chat.completions.create(**fields, tool_choice="required").choices[0]
    assert required.message.reasoning_content == "need it"  # type: ignore[attr-defined]
    assert [c.function.arguments for c in required.message.tool_calls or []] == [  # type: ignore[union-attr]
        call.function.arguments  # type: ignore[union-attr]
    ]
    chunks = list(client.chat.completions.create(**fields, stream=True))
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [  # type: ignore[union-attr]
        ("get_weather", '{"city": "Oslo"}')
    ]
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_responses_reasoning_item_and_function_call(stack: Stack) -> None:
    client = sdk(stack)
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": WEATHER["function"]["parameters"],
    }  # type: ignore[index]
    whole = client.responses.create(
        model="fake-echo", input=_user(SAYS_CALL), tools=[tool], reasoning={"effort": "low"},  # type: ignore[list-item]
        store=False,
    )  # fmt: skip
    assert [item.type for item in whole.output] == ["reasoning", "function_call"]
    assert whole.output[0].content[0].text == "need it"  # type: ignore[union-attr,index]
    assert whole.output[1].name == "get_weather"  # type: ignore[union-attr]
    events = list(client.responses.create(model="fake-echo", input=_user(SAYS_FINAL), stream=True,
                                          store=False))  # fmt: skip
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == ("plan", "answer")


def test_messages_api_thinking_and_tool_use(stack: Stack) -> None:
    """The Messages API, as raw JSON and server-sent events (tests/gateway/test_reasoning.py
    drives the same blocks with the anthropic SDK, whose import alone takes seconds)."""
    assert stack.http_url is not None
    url = stack.http_url + "/messages"
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    fields = {"model": "fake-echo", "max_tokens": 512, "messages": _user(SAYS_CALL)}
    message = httpx.post(url, json={**fields, "tools": [tool]}, timeout=30).json()
    assert [b["type"] for b in message["content"]] == ["thinking", "tool_use"]
    assert message["content"][0]["thinking"] == "need it"
    assert message["content"][1]["input"] == {"city": "Oslo"}
    assert message["stop_reason"] == "tool_use"
    streamed = {**fields, "messages": _user(SAYS_FINAL), "stream": True}
    with httpx.stream("POST", url, json=streamed, timeout=30) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    kinds = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    thinking = "".join(d.get("thinking", "") for d in deltas)
    assert (kinds, thinking, "".join(d.get("text", "") for d in deltas)) == (
        ["thinking", "text"], "plan", "answer",
    )  # fmt: skip


def test_thinking_sent_back_reaches_the_template(stack: Stack) -> None:
    """An assistant turn's reasoning_content goes back to the template (gpt-oss continues a
    tool-calling turn from its thinking), through /tokenize's chat path."""
    assert stack.http_url is not None
    base = stack.http_url.removesuffix("/v1")
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [*_user("Oslo?"), {"role": "assistant", "content": None, "tool_calls": [call],
                "reasoning_content": "need it"}, {"role": "tool", "tool_call_id": "c1",
                "content": "3 C"}]  # fmt: skip
    body = {"model": "fake-echo", "messages": messages, "tools": [WEATHER]}
    tokens = httpx.post(f"{base}/tokenize", json=body, timeout=30).json()["tokens"]
    text = httpx.post(f"{base}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    thought = "<|start|>assistant<|channel|>analysis<|message|>need it<|end|>"
    assert thought + CALL + "<|start|>functions.get_weather to=assistant" in text
