"""Tool calling's text side, without a model: the Hermes fallback's prompt, reading calls back
from whole answers and from streamed pieces split anywhere, tool_choice's checks, and the call
formats of other templates (Llama 3 JSON, Mistral [TOOL_CALLS]): their grammars and parsing."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from llmserve.common.structured_output import check_structured_output
from llmserve.common.tokenizer_files import byte_level_files
from llmserve.gateway.openai_protocol import ChatCompletionRequest, chat_request
from llmserve.gateway.openai_tools import AnswerStream, ToolPlan, read_answer, tool_plan
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.gateway.tool_formats import MISTRAL_CALLS, PYTHON_TAG, ToolFormat, tool_format_of
from llmserve.gateway.tool_prompt import CallStream, ChatTurn, fallback_turns, parse_tool_calls
from llmserve.gateway.validation import ValidationError

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
    text += stream.finish()[0]
    whole_content, whole_calls = parse_tool_calls(ANSWER, NAMES)
    assert text.strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_stream_releases_text_that_is_not_a_call() -> None:
    stream = CallStream(NAMES)
    assert stream.add("a <tool") == ("a ", [])
    assert stream.add("box> b") == ("<toolbox> b", [])
    assert stream.add("<tool_call>never closed") == ("", [])
    assert stream.finish() == ("<tool_call>never closed", [])


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


# -- the call format each template asks for ------------------------------------------------------
# Minimal templates written for these tests, each in the shape its family's template takes: the
# tools listed in the prompt, an assistant turn's calls in the family's format, tool results.

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nAnswer a call as "
    '{"name": function name, "parameters": its arguments}. Tools: {{ tools | tojson }}<|eot_id|>'
    "{% endif %}{% for m in messages %}<|start_header_id|>"
    "{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS][{% for c in m.tool_calls %}"
    "{% if c.id | length != 9 %}{{ raise_exception('tool call ids must be 9 long') }}{% endif %}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}, '
    '"id": "{{ c.id }}"}{% endfor %}]</s>{% elif m.role == "tool" %}[TOOL_RESULTS]'
    '{"call_id": "{{ m.tool_call_id }}", "content": {{ m.content }}}[/TOOL_RESULTS]'
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
QWEN_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools> Answer calls in <tool_call></tool_call>."
    "{% endif %}{% for m in messages %}{{ m.role }}: {% for c in m.tool_calls or [] %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{{ m.content }}\n{% endfor %}"
)
ANSWERS = {  # an answer with two calls (and content where the format allows it), per format
    "hermes": ANSWER,
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}},'
    ' {"name": "get_time", "arguments": {}}]',
}


SINGLE = {  # one call of get_time, per format
    "hermes": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
}


def special_tokenizer() -> Any:
    """The byte-level tokenizer with Mistral's [TOOL_CALLS] added as one special token."""
    tokenizer = byte_level_files().tokenizer
    tokenizer.add_special_tokens([MISTRAL_CALLS])
    return tokenizer


def formats() -> dict[str, ToolFormat]:
    token_id = special_tokenizer().token_to_id
    return {
        name: tool_format_of(template, token_id)
        for name, template in (
            ("hermes", QWEN_TEMPLATE),
            ("llama3_json", LLAMA3_TEMPLATE),
            ("mistral", MISTRAL_TEMPLATE),
        )
    }


def test_the_call_format_follows_the_template() -> None:
    assert {name: f.name for name, f in formats().items()} == {
        "hermes": "hermes", "llama3_json": "llama3_json", "mistral": "mistral",
    }  # fmt: skip
    assert tool_format_of(None).name == tool_format_of("{{ messages }}").name == "hermes"
    # the model's own template renders the tools, the calls (in its format) and the results
    files = byte_level_files()
    tokenizer = Tokenizer(files.tokenizer, LLAMA3_TEMPLATE, "<s>", None, False)
    assert tokenizer.tool_format.name == "llama3_json"
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    turns = [ChatTurn("user", "Oslo?"), ChatTurn("assistant", "", [call]),
             ChatTurn("tool", '{"temp": 3}', tool_call_id="c1")]  # fmt: skip
    text = tokenizer.render_chat(turns, tools=[WEATHER])
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"temp": 3}' in text
    assert '"name": "get_weather"' in text.split("<|eot_id|>")[0]  # the tools, in the prompt
    # Mistral's templates take only 9-character call ids: OpenAI's are mapped, call and result
    mistral = Tokenizer(files.tokenizer, MISTRAL_TEMPLATE, None, None, False)
    text = mistral.render_chat(turns, tools=[WEATHER])
    [short] = re.findall(r'"id": "(\w+)"', text)
    assert len(short) == 9 and f'{{"call_id": "{short}"' in text


def admits(constraint: Any, text: str) -> bool:
    """Whether llguidance's matcher for constraint accepts text whole."""
    tokenizer = special_tokenizer()
    vocab = LLTokenizer(tokenizer.to_str(), n_vocab=tokenizer.get_vocab_size(), eos_token=0)
    check_structured_output(constraint, "")
    grammar = LLMatcher.grammar_from_lark(constraint.grammar)
    matcher = LLMatcher(vocab, grammar, log_level=0)
    ids = tokenizer.encode(text).ids
    return (
        matcher.validate_tokens(ids) == len(ids)
        and matcher.consume_tokens(ids)
        and (matcher.is_accepting())
    )


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_required_and_named_grammars_admit_only_calls(name: str) -> None:
    """The grammar of tool_choice required (parallel) admits the format's calls whose arguments
    validate, and nothing else; named admits only that function; what it admits parses back to
    the same calls."""
    fmt = formats()[name]
    calls_only = ANSWERS[name].replace("Let me check.", "").removeprefix(PYTHON_TAG)
    required = tool_plan([WEATHER, TIME], "required", True, fmt).constraint
    assert admits(required, calls_only)
    assert not admits(required, calls_only.replace('"Oslo"', "3"))  # arguments must validate
    assert not admits(required, "Let me check." + calls_only)  # calls only
    named = {"type": "function", "function": {"name": "get_time"}}
    one = tool_plan([WEATHER, TIME], named, False, fmt).constraint
    assert not admits(one, calls_only)  # get_weather is not the named one, and one call only
    assert admits(one, SINGLE[name])
    content, calls = fmt.parse(calls_only, NAMES)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_auto_calls_stream_whole_and_equal_the_answer(name: str, size: int) -> None:
    """tool_choice auto: the calls read from streamed pieces equal those of the whole answer,
    no piece of a call streams as text, and an answer that is not a call streams as text."""
    fmt = formats()[name]
    answer = ANSWERS[name]
    whole_content, whole_calls = fmt.parse(answer, NAMES)
    assert len(whole_calls) == 2

    def streamed(text: str) -> tuple[str, list[dict[str, Any]]]:
        stream = fmt.stream(NAMES)
        out, calls = "", []
        for i in range(0, len(text), size):
            piece, done = stream.add(text[i : i + size])
            out += piece
            calls += done
        rest, last = stream.finish()
        return out + rest, calls + last

    text, calls = streamed(answer)
    assert "{" not in text and text.strip() == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    for plain in ("Sunny, 3 degrees.", "{not a call}", "[TOOL_CALLS] nothing"):
        assert streamed(plain) == (plain, []) and fmt.parse(plain, NAMES) == (plain, [])


TWICE = {  # get_time called twice, per format
    "hermes": SINGLE["hermes"] + "\n" + SINGLE["hermes"],
    "llama3_json": SINGLE["llama3_json"] + "; " + SINGLE["llama3_json"],
    "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, '
    '{"name": "get_time", "arguments": {}}]',
}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_named_choice_is_exactly_one_call(name: str) -> None:
    """A named tool_choice admits one call, also with parallel_tool_calls true (its default);
    required with parallel admits the two the named one refuses."""
    fmt = formats()[name]
    plan = tool_plan([WEATHER, TIME], NAMED, True, fmt)
    assert admits(plan.constraint, SINGLE[name])
    assert not admits(plan.constraint, TWICE[name])
    assert admits(tool_plan([WEATHER, TIME], "required", True, fmt).constraint, TWICE[name])


def _streamed(plan: ToolPlan, fmt: ToolFormat, text: str, size: int) -> tuple[str, list]:
    stream = AnswerStream(plan, fmt)
    out, calls = "", []
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        content, done = stream.add(piece, last=k == len(pieces) - 1)
        out, calls = out + content, calls + done
    return out, calls


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_parallel_false_keeps_one_call_in_every_mode(name: str, size: int) -> None:
    """parallel_tool_calls false (or a named function) reads at most one call back, whole and
    streamed, even when the text holds two (auto has no grammar to stop the model)."""
    fmt = formats()[name]
    for choice in ("auto", "required", NAMED):
        plan = tool_plan([WEATHER, TIME], choice, choice == NAMED, fmt)
        _, calls = read_answer(plan, fmt, TWICE[name])
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        _, streamed = _streamed(plan, fmt, TWICE[name], size)
        assert [c["function"]["name"] for c in streamed] == ["get_time"]
    _, calls = read_answer(tool_plan([WEATHER, TIME], "auto", True, fmt), fmt, TWICE[name])
    assert len(calls) == 2


@pytest.mark.parametrize("size", [1, 5, 1000])
@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_no_call_markup_in_content(name: str, size: int) -> None:
    """A call cut by max_tokens never reaches content, whole or streamed: a forced answer's
    content is empty, an auto answer keeps only the text before the markup."""
    fmt = formats()[name]
    cut = ANSWERS[name][: ANSWERS[name].index("Oslo")]
    forced = tool_plan([WEATHER, TIME], NAMED, True, fmt)
    assert read_answer(forced, fmt, cut) == ("", [])
    assert _streamed(forced, fmt, cut, size) == ("", [])
    auto = tool_plan([WEATHER, TIME], "auto", True, fmt)
    for content, calls in (read_answer(auto, fmt, cut), _streamed(auto, fmt, cut, size)):
        assert calls == [] and "{" not in content and "<" not in content.replace("Let", "")
        assert content.strip() in ("", "Let me check.")


def test_bad_parameters_are_named_as_the_client_wrote_them() -> None:
    bad = {"type": "function", "function": {"name": "g", "parameters": {"type": "frob"}}}
    with pytest.raises(ValidationError, match=r"^tools\[1\]\.function\.parameters ") as err:
        tool_plan([TIME, bad], "required", True)
    assert "%json" not in str(err.value) and "start:" not in str(err.value)
