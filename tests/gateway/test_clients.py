"""The OpenAI surface driven by the clients people point at an OpenAI-compatible server
(openai's Responses API, openai-agents, langchain-openai, litellm), on one shared echo stack:
what each client needs the server to send is read from the client's own parsed objects, not
from our JSON.

The echo engine answers a chat with the rendered prompt's bytes: for USER the content is
"user\\nhi", then its EOS (finish reason "stop"); tests/gateway/test_openai_api.py explains the
echo. So the answer is the first message's text: a system message (instructions) holding a call in
the Hermes format makes "the model" call a tool.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

# litellm fetches its model price list from the internet at import unless told to use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import openai
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_openai import ChatOpenAI
from openai.types.responses import Response

from tests.stack import Stack, start_echo_stack

# litellm's TypedDicts make pydantic warn at import-time schema building: not ours to fix
pytestmark = [pytest.mark.stack, pytest.mark.filterwarnings("ignore::UserWarning")]
ANSWER = "user\nhi"  # the echo of USER's rendered prompt
MODEL = "fake-echo"


@pytest.fixture(scope="module")
def stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        "--max-model-len",
        "2048",
        "--num-kv-blocks",
        "256",
        http=True,
    )
    yield s
    s.close()


def url(stack: Stack) -> str:
    assert stack.http_url is not None
    return stack.http_url


def post(stack: Stack, path: str, body: dict[str, Any]) -> httpx2.Response:
    return httpx2.post(url(stack) + path, json=body)


def tokenize(stack: Stack, text: str) -> list[int]:
    """text's prompt token ids, from the server's /tokenize."""
    body = {"prompt": text}
    return list(
        httpx2.post(url(stack).removesuffix("/v1") + "/tokenize", json=body).json()["tokens"]
    )


def decode(stack: Stack, ids: list[int]) -> str:
    """ids' text, from the server's /detokenize."""
    body = {"tokens": ids}
    return str(
        httpx2.post(url(stack).removesuffix("/v1") + "/detokenize", json=body).json()["prompt"]
    )


def stack_idle(stack: Stack) -> None:
    stack.assert_idle()


def prompt_tokens(stack: Stack) -> int:
    """USER's prompt length, from the server's /tokenize."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    return int(httpx2.post(url(stack).removesuffix("/v1") + "/tokenize", json=body).json()["count"])


# -- openai: the Responses API ------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CALL_WEATHER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(stack), api_key="none", max_retries=0)


def test_responses_create_and_stream(stack: Stack) -> None:
    """A response whole and streamed: the same text, usage from the same prompt, the body valid
    under the SDK's own Response model, and the stream's events in the Responses API's order."""
    client = sdk(stack)
    whole = client.responses.create(model=MODEL, input="hi", store=False)
    assert whole.output_text == ANSWER and whole.status == "completed"
    assert whole.usage is not None and whole.usage.input_tokens == prompt_tokens(stack)
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    raw = httpx2.post(url(stack) + "/responses", json={"model": MODEL, "input": "hi"})
    Response.model_validate(raw.json(), strict=False)  # every required field, typed as OpenAI's
    assert raw.json()["id"].startswith("resp_")
    events = list(client.responses.create(model=MODEL, input="hi", stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    text_done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in text_done] == [ANSWER]
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == ANSWER and final.usage.input_tokens == whole.usage.input_tokens


def test_responses_function_call_streamed_and_not(stack: Stack) -> None:
    """A call in the model's text comes back as a function_call item (never in the text);
    streamed, as function_call_arguments events; a later turn may send it back with its output."""
    client = sdk(stack)
    fields: dict[str, Any] = {"model": MODEL, "instructions": CALL_WEATHER, "tools": [WEATHER_TOOL]}
    whole = client.responses.create(input="weather?", **fields)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert "<tool_call>" not in whole.output_text
    events = list(client.responses.create(input="weather?", stream=True, **fields))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.name, json.loads(e.arguments)) for e in done] == [("get_weather", {"city": "Oslo"})]
    assert "<tool_call>" not in "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )
    turn = [
        {"role": "user", "content": "weather?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]  # fmt: skip
    after = client.responses.create(model=MODEL, input=turn, tools=[WEATHER_TOOL])  # type: ignore[arg-type]
    assert after.status == "completed"


def test_responses_store_and_previous_response_id(stack: Stack) -> None:
    """A stored response is read back, continued (its conversation comes first: the echo answers
    the first message, "hi"), deleted, and then a clear 400 / 404."""
    client = sdk(stack)
    first = client.responses.create(model=MODEL, input="hi")
    assert client.responses.retrieve(first.id).output_text == ANSWER
    later = client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert later.output_text == ANSWER and later.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="again", store=False)
    assert alone.output_text == "user\nagain"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store: false
    client.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="again", previous_response_id=first.id)
    assert err.value.code == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]


@pytest.mark.parametrize(
    ("fields", "param", "names"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input",
         "input[0].content[0].type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}},
         "text", "text.format.schema"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
        ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
          "name": "nope"}}, "tool_choice", "tool_choice.name"),
        ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens"),
        ({"input": "hi", "top_k": 2**40}, "top_k", "top_k="),  # was a 500
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools", "tools[0].name="),
    ],
)  # fmt: skip
def test_responses_refusals_name_the_field(
    stack: Stack, fields: dict[str, Any], param: str, names: str
) -> None:
    reply = httpx2.post(url(stack) + "/responses", json={"model": MODEL, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(names), error


def test_responses_incomplete_and_a_streamed_one_stored(stack: Stack) -> None:
    client = sdk(stack)
    cut = client.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    # three tokens: the echo's <|im_start|> (no text), "u", "s"
    assert cut.status == "incomplete" and cut.output_text == ANSWER[:2]
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, input="hi", stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == ANSWER


def test_completions_echo(stack: Stack) -> None:
    """echo puts the prompt before the completion, streamed (the first chunk) and not."""
    client = sdk(stack)
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=4, echo=True)
    assert whole.choices[0].text == "abc" + "abca"
    chunks = list(
        client.completions.create(model=MODEL, prompt="abc", max_tokens=4, echo=True, stream=True)
    )
    assert chunks[0].choices[0].text == "abc"
    assert "".join(c.choices[0].text for c in chunks) == "abcabca"


def echo_scores(token_ids: list[int], k: int) -> list[dict[int, tuple[float, int]] | None]:
    """The echo engine's prompt scores (engine/contract/echo.py): prompt token j (j >= 1) has
    logprob -0.5 * (j % 3) at rank 1 + j % 3, its top-k token t - j % 3 + m at -0.5 * m;
    {token id: (logprob, rank)} per position, the prompt's token first, None first."""
    out: list[dict[int, tuple[float, int]] | None] = [None]
    for j, t in enumerate(token_ids[1:], start=1):
        entry = {t: (-0.5 * (j % 3), 1 + j % 3)}
        for m in range(k):
            entry.setdefault(t - j % 3 + m, (-0.5 * m, m + 1))
        out.append(entry)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_with_logprobs(stack: Stack, stream: bool) -> None:
    """echo with logprobs (OpenAI's legacy API, what lm-eval's local-completions sends): the
    prompt's tokens come first in the choice's logprobs, the first with null logprob and
    top_logprobs; streamed, with the first chunk. A token-id prompt works the same."""
    client = sdk(stack)
    ids = tokenize(stack, "abcd")
    for prompt in ("abcd", ids):
        result = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, echo=True, logprobs=2, stream=stream
        )
        choices = [c.choices[0] for c in result] if stream else result.choices  # type: ignore[union-attr]
        first = choices[0]
        assert first.logprobs is not None
        assert "".join(c.text for c in choices) == "abcd" + "ab"
        tokens = [t for c in choices for t in (c.logprobs.tokens or [])]  # type: ignore[union-attr]
        lps = [t for c in choices for t in (c.logprobs.token_logprobs or [])]  # type: ignore[union-attr]
        tops = [t for c in choices for t in (c.logprobs.top_logprobs or [])]  # type: ignore[union-attr]
        offsets = [t for c in choices for t in (c.logprobs.text_offset or [])]  # type: ignore[union-attr]
        n = len(ids)
        assert tokens == [*(decode(stack, [t]) for t in ids), "a", "b"]
        expected = echo_scores(ids, 2)
        assert lps[0] is None and tops[0] is None
        assert lps[1:n] == [e[t][0] for e, t in zip(expected[1:], ids[1:], strict=True)]  # type: ignore[index]
        assert lps[n:] == [0.0, 0.0]  # the echo engine's sampled tokens
        # top_logprobs: the two most likely, and the prompt's token (OpenAI lists the chosen one)
        for j in range(1, n):
            top = {decode(stack, [t]): lp for t, (lp, r) in expected[j].items() if r <= 2}  # type: ignore[union-attr]
            top.setdefault(decode(stack, [ids[j]]), expected[j][ids[j]][0])  # type: ignore[index]
            assert tops[j] == top
        assert offsets == list(range(n + 2))  # one character per token here
    stack_idle(stack)


def test_completions_echo_prompt_only_and_prompt_logprobs(stack: Stack) -> None:
    """max_tokens 0 with echo returns the prompt alone (lm-eval's scoring calls, vLLM allows
    it); vLLM's prompt_logprobs gives {token id: {logprob, rank, decoded_token}} per prompt
    position, null first, on completions and chat; asked with stream, a 400 naming it."""
    ids = tokenize(stack, "abcd")
    body = {"model": MODEL, "prompt": "abcd", "max_tokens": 0, "echo": True, "logprobs": 0}
    [choice] = post(stack, "/completions", body).json()["choices"]
    assert choice["text"] == "abcd" and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 1}
    response = post(stack, "/completions", body).json()
    [choice] = response["choices"]
    assert response["usage"]["completion_tokens"] == 1
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j, entry in enumerate(echo_scores(ids, 1)[1:], start=1):
        assert entry is not None
        want = {str(t): {"logprob": lp, "rank": r, "decoded_token": decode(stack, [t])}
                for t, (lp, r) in entry.items()}  # fmt: skip
        assert got[j] == want
    user = [{"role": "user", "content": "hi"}]
    chat = {"model": MODEL, "messages": user, "max_tokens": 1, "prompt_logprobs": 0}
    response = post(stack, "/chat/completions", chat).json()
    assert response["prompt_logprobs"][0] is None
    assert len(response["prompt_logprobs"]) == prompt_tokens(stack)
    # Out of range: tests/gateway/test_openai_api.py's refusals; streamed (as vLLM: not with
    # stream) and max_tokens 0 without echo:
    for bad, field in [
        ({**body, "stream": True}, "prompt_logprobs"),
        ({**body, "max_tokens": 0}, "max_tokens"),
    ]:
        reply = post(stack, "/completions", bad)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == field, reply.text
    stack_idle(stack)


def test_stop_reason_names_what_stopped(stack: Stack) -> None:
    """vLLM's stop_reason: the stop string, the stop token id, or null (length, EOS); and, as
    vLLM's choices, prompt_logprobs (null unless asked)."""
    client = sdk(stack)
    fields: dict[str, Any] = {"model": MODEL, "prompt": "abcdef", "max_tokens": 6}
    by_string = client.completions.create(stop=["cd"], **fields).choices[0]
    assert (by_string.text, by_string.model_extra) == (
        "ab",
        {"stop_reason": "cd", "prompt_logprobs": None},
    )
    by_token = client.completions.create(extra_body={"stop_token_ids": [ord("c")]}, **fields)
    assert by_token.choices[0].model_extra == {"stop_reason": ord("c"), "prompt_logprobs": None}
    by_length = client.completions.create(**fields).choices[0]
    assert by_length.finish_reason == "length" and by_length.model_extra == {
        "stop_reason": None,
        "prompt_logprobs": None,
    }


# -- openai-agents ---------------------------------------------------------------------------------


def test_openai_agents_runs_a_tool_once(stack: Stack) -> None:
    """An Agent on its default model (the Responses API): turn 1 calls get_weather (the
    instructions hold the call), the Agent runs it once and sends its output back as items;
    turn 2 answers in text, which is the final output."""
    agents = pytest.importorskip("agents")
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    def instructions(context: Any, agent: Any) -> str:
        return "Answer: sunny" if ran else CALL_WEATHER

    client = openai.AsyncOpenAI(base_url=url(stack), api_key="none", max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions=instructions,
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
    )
    config = agents.RunConfig(tracing_disabled=True)
    result = agents.Runner.run_sync(agent, "weather in Oslo?", run_config=config, max_turns=3)
    assert ran == ["Oslo"]
    assert str(result.final_output).startswith("system\nAnswer: sunny")
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert [o.output for o in outputs] == ["sunny"]


# -- pydantic-ai -----------------------------------------------------------------------------------


def pydantic_ai_model(stack: Stack, kind: str = "OpenAIChatModel") -> Any:
    models = pytest.importorskip("pydantic_ai.models.openai")
    providers = pytest.importorskip("pydantic_ai.providers.openai")
    provider = providers.OpenAIProvider(base_url=url(stack), api_key="none")
    return getattr(models, kind)(MODEL, provider=provider)


@pytest.mark.parametrize("kind", ["OpenAIChatModel", "OpenAIResponsesModel"])
def test_pydantic_ai_runs_a_tool_once(stack: Stack, kind: str) -> None:
    """pydantic-ai's Agent over chat completions and over the Responses API: turn 1 calls the
    tool (its instructions hold the call), the tool runs once, turn 2's text is the output."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    ran: list[str] = []
    agent = pydantic_ai.Agent(pydantic_ai_model(stack, kind))

    @agent.instructions
    def instructions() -> str:
        return "Answer: sunny" if ran else CALL_WEATHER

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    result = agent.run_sync("weather in Oslo?")
    assert ran == ["Oslo"]
    assert result.output.startswith("system\nAnswer: sunny")


def test_pydantic_ai_structured_output(stack: Stack) -> None:
    """An output type read through pydantic-ai's output tool (its default way): "the model"
    calls final_result with the object's fields, which the Agent validates into the type."""
    pydantic_ai = pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel

    class Weather(BaseModel):
        city: str
        celsius: int

    call = '<tool_call>{"name": "final_result", "arguments": {"city": "Oslo", "celsius": 7}}'
    agent = pydantic_ai.Agent(
        pydantic_ai_model(stack), output_type=Weather, instructions=call + "</tool_call>"
    )
    result = agent.run_sync("weather in Oslo?")
    assert result.output == Weather(city="Oslo", celsius=7)


# -- anthropic: the Messages API -------------------------------------------------------------------


def claude(stack: Stack) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(
        base_url=url(stack).removesuffix("/v1"), api_key="none", max_retries=0
    )


ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": WEATHER_TOOL["parameters"],
}


def test_anthropic_messages_and_stream(stack: Stack) -> None:
    """The anthropic SDK's create and stream: the text, stop reason and usage as it parses
    them; the stream's events in Anthropic's order; count_tokens agrees with the usage."""
    client = claude(stack)
    user = [{"role": "user", "content": "hi"}]
    message = client.messages.create(model=MODEL, max_tokens=64, messages=user)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == ANSWER
    assert message.stop_reason == "end_turn" and message.id.startswith("msg_")
    assert message.usage.input_tokens == prompt_tokens(stack)
    stopped = client.messages.create(
        model=MODEL, max_tokens=64, messages=user, stop_sequences=["\nh"]
    )
    assert (stopped.content[0].text, stopped.stop_reason) == ("user", "stop_sequence")
    assert stopped.stop_sequence == "\nh"
    counted = client.messages.count_tokens(model=MODEL, messages=user)
    assert counted.input_tokens == message.usage.input_tokens
    with client.messages.stream(model=MODEL, max_tokens=64, messages=user) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == message.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.index("content_block_start") < kinds.index("content_block_stop")
    assert "message_delta" in kinds


def test_anthropic_tool_use_and_result(stack: Stack) -> None:
    """A call in the model's text is a tool_use block (stop_reason tool_use), whole and
    streamed (input_json_delta, accumulated by the SDK); the next turn's tool_use and
    tool_result blocks are accepted."""
    client = claude(stack)
    fields: dict[str, Any] = {
        "model": MODEL, "max_tokens": 900, "system": CALL_WEATHER, "tools": [ANTHROPIC_TOOL],
    }  # fmt: skip
    user = [{"role": "user", "content": "weather?"}]
    message = client.messages.create(messages=user, **fields)
    uses = [b for b in message.content if b.type == "tool_use"]
    assert [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Oslo"})]
    assert message.stop_reason == "tool_use"
    assert all("<tool_call>" not in b.text for b in message.content if b.type == "text")
    with client.messages.stream(messages=user, **fields) as stream:
        final = stream.get_final_message()
    streamed = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert streamed == [("get_weather", {"city": "Oslo"})] and final.stop_reason == "tool_use"
    turn = [
        *user,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny"},
        ]},
    ]  # fmt: skip
    after = client.messages.create(
        model=MODEL, max_tokens=900, messages=turn, tools=[ANTHROPIC_TOOL]
    )
    assert after.stop_reason == "end_turn"  # the system message's echo: the tools, no call


def test_anthropic_errors_in_its_shape(stack: Stack) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = claude(stack)
    image = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=8, messages=image)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert err.value.body["error"]["message"].startswith("messages[0].content[0].type='image'")
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": "hi"}],
            tools=[ANTHROPIC_TOOL],
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert err.value.body["error"]["message"].startswith("tool_choice.name='nope'")


# -- langchain-openai ------------------------------------------------------------------------------


def chat_model(stack: Stack, **fields: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=url(stack), api_key="none", model=MODEL, max_retries=0, **fields)  # type: ignore[call-arg]


def test_langchain_invoke_and_stream(stack: Stack) -> None:
    """invoke: content, finish reason and usage as langchain parses them; stream: the same
    content in chunks, the finish reason on the last content chunk and the usage chunk."""
    llm = chat_model(stack, stream_usage=True)
    message = llm.invoke([HumanMessage("hi")])
    assert message.content == ANSWER
    assert message.response_metadata["finish_reason"] == "stop"
    usage = message.usage_metadata
    assert usage is not None and usage["input_tokens"] == prompt_tokens(stack)
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    chunks = list(llm.stream([HumanMessage("hi")]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(str(c.content) for c in chunks) == ANSWER
    finished = [c.response_metadata.get("finish_reason") for c in chunks]
    assert "stop" in finished and finished.count("stop") == 1
    streamed_usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert streamed_usage and streamed_usage[-1]["input_tokens"] == usage["input_tokens"]


def test_langchain_responses_mode(stack: Stack) -> None:
    """langchain's Responses mode (use_responses_api) reads the same answer, whole and streamed,
    with usage."""
    llm = chat_model(stack, use_responses_api=True)
    message = llm.invoke([HumanMessage("hi")])
    assert message.text == ANSWER
    assert message.usage_metadata is not None
    assert message.usage_metadata["input_tokens"] == prompt_tokens(stack)
    chunks = list(llm.stream([HumanMessage("hi")]))
    assert "".join(c.text for c in chunks) == ANSWER


# -- litellm ---------------------------------------------------------------------------------------


def litellm_fields(stack: Stack) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": url(stack), "api_key": "none"}


def test_litellm_completion_and_stream(stack: Stack) -> None:
    reply = litellm.completion(
        messages=[{"role": "user", "content": "hi"}], max_tokens=32, **litellm_fields(stack)
    )
    assert reply.choices[0].message.content == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == prompt_tokens(stack)
    chunks = list(
        litellm.completion(
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
            **litellm_fields(stack),
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and set(reasons[:-1]) <= {None}


def test_litellm_reads_a_context_overflow_as_one(stack: Stack) -> None:
    """litellm maps our 400 to ContextWindowExceededError (its fallbacks hang on it), for a long
    prompt and for max_tokens past what the prompt leaves; another 400 stays a BadRequestError."""
    for messages, max_tokens in (
        ([{"role": "user", "content": "x" * 2100}], 8),
        ([{"role": "user", "content": "hi"}], 2100),
    ):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(messages=messages, max_tokens=max_tokens, **litellm_fields(stack))
    with pytest.raises(litellm.BadRequestError) as err:
        litellm.completion(
            messages=[{"role": "user", "content": "hi"}], top_p=7.0, **litellm_fields(stack)
        )
    assert not isinstance(err.value, litellm.ContextWindowExceededError)
