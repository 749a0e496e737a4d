"""Structured output through the whole stack on the built-in model (SmolLM2-135M): OpenAI's
response_format and vLLM's structured_outputs on both HTTP endpoints, streamed and not, and the
gRPC API's sampling.structured_output. Every output must parse and validate (jsonschema, with
formats checked); bad constraints are 400s naming the field. One stack for the module; the
good requests go out together, 16 at a time, from one fixture."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from llmserve.client import make_request
from llmserve.common.structured_output import (
    MAX_CONSTRAINT_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_SCHEMA_PROPERTIES,
)
from llmserve.protos.common_pb2 import ChoiceList, StructuredOutput
from tests.stack import Stack, start_stack
from tests.structured_schemas import SCHEMAS

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{1,30} "."'
MAX_TOKENS = 100
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def stack(builtin_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        None,
        engine_args=["--kv-cache-gb", "0.5", "--max-num-seqs", "16", "--num-threads", "1"],
        http=True,
        log_dir=tmp_path_factory.mktemp("logs"),
        timeout=300,
    )
    yield s
    s.close()


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url, api_key="none", max_retries=0, timeout=600)


def ask(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    """The request names what it wants but not the schema: only the grammar makes the output
    fit it (and the prompts stay short: with the schema written in, prefill took 40% of the
    workload's time)."""
    return [{"role": "user", "content": f"Give an example {name.replace('_', ' ')} as JSON."}]


Outcome = tuple[str, str | None]  # text, finish reason


def chat(stack: Stack, messages: list[dict[str, str]], stream: bool, **extra: Any) -> Outcome:
    client = sdk(stack)
    fields: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": MAX_TOKENS}
    fields["temperature"] = 0.0
    if "response_format" in extra:
        fields["response_format"] = extra.pop("response_format")
    if not stream:
        reply = client.chat.completions.create(**fields, extra_body=extra)
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**fields, stream=True, extra_body=extra):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def complete(stack: Stack, prompt: str | list[int], stream: bool, **extra: Any) -> Outcome:
    client = sdk(stack)
    fields: dict[str, Any] = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS}
    fields["temperature"] = 0.0
    if not stream:
        reply = client.completions.create(**fields, extra_body=extra)
        return reply.choices[0].text, reply.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.completions.create(**fields, stream=True, extra_body=extra):
        text += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


def workload(stack: Stack) -> dict[str, Callable[[], Outcome]]:
    """Every good request, by name: the schemas in turn through response_format (chat, not
    streamed) and structured_outputs (chat, streamed); regex, choice and grammar on
    /v1/completions (not streamed) and on /v1/chat/completions (streamed); a prompt given as
    token ids."""
    work: dict[str, Callable[[], Outcome]] = {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        messages = ask(name, schema)
        if i % 2 == 0:
            work[name] = lambda m=messages, f=fmt: chat(stack, m, False, response_format=f)
        else:
            work[name] = lambda m=messages, s=schema: chat(
                stack, m, True, structured_outputs={"json": s}
            )
    kinds = {
        "regex": ({"regex": REGEX}, "A city name and a number: "),
        "choice": ({"choice": CHOICES}, "The sentiment of 'I love it' is: "),
        "grammar": ({"grammar": GRAMMAR}, "Is the sky blue? Answer: "),
    }
    for kind, (spec, prompt) in kinds.items():
        work[f"{kind}/completions"] = lambda s=spec, p=prompt: complete(
            stack, p, False, structured_outputs=s
        )
        work[f"{kind}/chat-stream"] = lambda s=spec, p=prompt: chat(
            stack, [{"role": "user", "content": p}], True, structured_outputs=s
        )
    work["token_ids"] = lambda: complete(
        stack, [1, 504, 3458, 282], False, structured_outputs={"choice": CHOICES}
    )
    return work


@pytest.fixture(scope="module")
def outcomes(stack: Stack) -> dict[str, Outcome]:
    work = workload(stack)
    with ThreadPoolExecutor(16) as pool:
        futures = {name: pool.submit(fn) for name, fn in work.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_schema_outputs_validate(outcomes: dict[str, Outcome], name: str) -> None:
    """Half of the schemas streamed, half not (alternating)."""
    text, finish = outcomes[name]
    assert finish == "stop", (name, text)
    jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS)


def test_schemas_cover_the_features() -> None:
    text = json.dumps(SCHEMAS)
    features = ("minItems", "maxItems", "enum", "pattern", "format", "minimum", "$defs", "$ref")
    for feature in (*features, "anyOf", "maxLength", "exclusiveMinimum", '"required": []'):
        assert feature in text, feature
    assert len(SCHEMAS) >= 30


def test_regex_choice_grammar(outcomes: dict[str, Outcome]) -> None:
    checks = {
        "regex": lambda t: re.fullmatch(REGEX, t),
        "choice": lambda t: t in CHOICES,
        "grammar": lambda t: re.fullmatch(r"(yes|no) because [a-z ]{1,30}\.", t),
    }
    for name, (text, finish) in outcomes.items():
        kind = name.split("/")[0]
        if "/" in name and kind in checks:
            assert finish == "stop" and checks[kind](text), (name, text)
    text, finish = outcomes["token_ids"]
    assert finish == "stop" and text in CHOICES


def test_json_object(stack: Stack) -> None:
    """Any JSON object (a small model left to itself may nest without end: the prompt shows a
    short one)."""
    ask_short = 'Answer with this JSON object and nothing else: {"ok": true}'
    text, finish = chat(
        stack, [{"role": "user", "content": ask_short}], False,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_grpc_structured_output(stack: Stack) -> None:
    so = StructuredOutput(choice=ChoiceList(choices=CHOICES))
    req = make_request("The sentiment of 'awful' is: ", max_tokens=8, temperature=0.0)
    req.sampling.structured_output.CopyFrom(so)
    with stack.client() as client:
        done = client.generate(req, timeout=300)
        assert done.finish_reason == "stop" and done.text in CHOICES
        bad = make_request("x", max_tokens=8)
        bad.sampling.structured_output.regex = "a(b"
        with pytest.raises(grpc.RpcError) as err:
            client.generate(bad, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured_output.regex does not compile" in err.value.details()


def test_n_choices_each_valid(stack: Stack) -> None:
    """n = 2, sampled: two scheduler requests, each with its own matcher."""
    reply = sdk(stack).completions.create(
        model="m", prompt="My favourite colour is", max_tokens=8, n=2, temperature=1.0, seed=5,
        extra_body={"structured_outputs": {"regex": "(red|green|blue)( and (red|green|blue))?"}},
    )  # fmt: skip
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert re.fullmatch(r"(red|green|blue)( and (red|green|blue))?", choice.text), choice


def test_max_tokens_mid_object_is_length(stack: Stack) -> None:
    schema = SCHEMAS["order"]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema}}
    reply = sdk(stack).chat.completions.create(
        model="m", messages=ask("order", schema), max_tokens=6, temperature=0.0,
        response_format=fmt,  # type: ignore[arg-type]
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content.startswith("{")  # type: ignore[union-attr]


def _deep(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
            "response_format.json_schema.schema does not compile: ",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        (
            {"structured_outputs": {"grammar": "root ::= nothing"}},
            "structured_outputs",
            "not found",
        ),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "1 to 1024 are allowed"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        (
            {"structured_outputs": {"json": _deep(MAX_SCHEMA_DEPTH)}},
            "structured_outputs",
            f"the limit is {MAX_SCHEMA_DEPTH}",
        ),
        (
            {
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "properties": {
                            f"p{i}": {"type": "integer"} for i in range(MAX_SCHEMA_PROPERTIES + 1)
                        },
                    }
                }
            },
            "structured_outputs",
            f"the limit is {MAX_SCHEMA_PROPERTIES}",
        ),
        (
            {"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}},
            "structured_outputs",
            f"has {MAX_CONSTRAINT_BYTES + 1} bytes; the limit is {MAX_CONSTRAINT_BYTES}",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= root "a"'}},
            "structured_outputs",
            "its language is empty: no text satisfies it",
        ),
        (
            {"structured_outputs": {"grammar": 'start: start "a"'}},
            "structured_outputs",
            "its language is empty",
        ),
        ({"structured_outputs": {"json": {"$ref": "#"}}}, "structured_outputs", "is empty"),
        ({"response_format": {"type": "yaml"}}, "response_format", "must be 'text'"),
        ({"prompt": [1, 2, 10**6]}, "prompt", "prompt[2]=1000000 is outside the vocabulary"),
        ({"prompt": ["a", [1]]}, "prompt", "Input should be a valid string"),
    ],
)
def test_bad_constraints_are_400(
    stack: Stack, extra: dict[str, Any], param: str, message: str
) -> None:
    prompt = extra.pop("prompt", "hi")
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).completions.create(model="m", prompt=prompt, max_tokens=4, extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.param == param, err.value.message
    assert message in err.value.message, err.value.message


# -- tool calling ---------------------------------------------------------------------------------

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME_PARAMS}},
]  # fmt: skip
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def tool_chat(stack: Stack, **fields: Any) -> Any:
    fields = {"model": "m", "messages": QUESTION, "max_tokens": 80, "temperature": 0.0,
              "tools": TOOLS, **fields}  # fmt: skip
    return sdk(stack).chat.completions.create(**fields)


def check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.fixture(scope="module")
def tool_replies(stack: Stack) -> dict[str, Any]:
    """The tool requests, sent together."""
    named = {"type": "function", "function": {"name": "get_time"}}
    work: dict[str, Callable[[], Any]] = {
        "required": lambda: tool_chat(stack, tool_choice="required"),
        "single": lambda: tool_chat(stack, tool_choice="required", parallel_tool_calls=False),
        "named": lambda: tool_chat(stack, tool_choice=named),
        "none": lambda: tool_chat(stack, tool_choice="none", max_tokens=16),
        "auto": lambda: tool_chat(stack),
        "stream": lambda: list(tool_chat(stack, tool_choice="required", stream=True)),
    }
    with ThreadPoolExecutor(len(work)) as pool:
        futures = {name: pool.submit(fn) for name, fn in work.items()}
        return {name: f.result() for name, f in futures.items()}


def test_tool_choice_required_named_single(tool_replies: dict[str, Any]) -> None:
    for name, names in (
        ("required", set(PARAMS)),
        ("single", set(PARAMS)),
        ("named", {"get_time"}),
    ):
        choice = tool_replies[name].choices[0]
        assert choice.finish_reason == "tool_calls", (name, choice)
        check_calls(choice.message.tool_calls, names)
    assert len(tool_replies["single"].choices[0].message.tool_calls) == 1


def test_tool_choice_none_and_auto(tool_replies: dict[str, Any]) -> None:
    none = tool_replies["none"].choices[0]
    assert none.message.tool_calls is None and none.message.content
    assert none.finish_reason in ("stop", "length")
    auto = tool_replies["auto"].choices[0]
    if auto.message.tool_calls:  # the model's choice; whatever it said must parse
        assert auto.finish_reason == "tool_calls"
        for call in auto.message.tool_calls:
            assert call.function.name in PARAMS and json.loads(call.function.arguments) is not None
    else:
        assert auto.message.content and auto.finish_reason in ("stop", "length")


def test_streamed_calls_reassemble_to_the_answer(tool_replies: dict[str, Any]) -> None:
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in tool_replies["stream"]:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            assert not (choice.delta.content or "").strip()  # nothing of a call as text
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    whole = tool_replies["required"].choices[0].message.tool_calls
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole
    ]


def test_tool_result_round_trip(stack: Stack, tool_replies: dict[str, Any]) -> None:
    call = tool_replies["named"].choices[0].message.tool_calls[0]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    reply = tool_chat(stack, messages=messages, tool_choice="auto", max_tokens=24)
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage.prompt_tokens > 40  # the tools, the call and its result were rendered


def test_unknown_tool_choice_is_400(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tool_chat(stack, tool_choice={"type": "function", "function": {"name": "launch"}})
    assert err.value.param == "tool_choice"
    assert "'launch' is not one of the tools (get_time, get_weather)" in err.value.message
