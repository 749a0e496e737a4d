"""The OpenAI-compatible HTTP API, driven by the official `openai` package against the real stack
(gateway, scheduler and the echo engine over gRPC; a tiny random Llama where sampling matters).

The echo engine returns the prompt's tokens cyclically and the test tokenizer has one token per
byte, so the expected text is known exactly. A chat prompt renders as
"<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n", whose echo is
"user\\n{content}" followed by <|im_end|>, the EOS: finish reason "stop".
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx2
import openai
import pytest

from llmserve.client import Client, make_request
from llmserve.gateway.choices import choice_seed
from llmserve.gateway.http_errors import http_message
from llmserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    completion_requests,
)
from llmserve.gateway.validation import ValidationError
from tests.stack import Stack, start_echo_stack, start_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

T = TypeVar("T")
API_KEY = "test-key-123"
USER = [{"role": "user", "content": "hi"}]


def echo(prompt: str, n: int) -> str:
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The gateway's --served-model-name (the echo engine calls itself "fake-echo").
SERVED_NAME = "tiny-echo"


def _echo_stack(tokenizer_dir: Path, log_dir: Path, *engine: str, scheduler: tuple = ()) -> Stack:
    return start_echo_stack(
        tokenizer_dir,
        log_dir,
        *engine,
        scheduler=scheduler,
        # fake-echo, the name the requests use, is an alias; any other name is 404 (the default)
        gateway_args=["--served-model-name", SERVED_NAME, "fake-echo"],
        http=True,
        api_key=API_KEY,
        accept_any_model=False,
        # the front services at the engine's priority: the timing tests here measure the
        # gateway's event loop, not how it shares the CPU with other processes (under xdist the
        # other worker's tests run at nice 0 beside a gateway at LLMSERVE_FRONT_NICE's 5)
        env={"LLMSERVE_FRONT_NICE": "0"},
    )


@pytest.fixture(scope="module")
def stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = _echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        "--fake-step-delay-ms",
        "5",
        "--num-kv-blocks",
        "64",
        "--max-model-len",
        "512",
    )
    yield s
    s.close()


def sdk(stack: Stack, api_key: str = API_KEY, **options: Any) -> openai.OpenAI:
    assert stack.http_url is not None
    return openai.OpenAI(base_url=stack.http_url, api_key=api_key, max_retries=0, **options)


def root_url(stack: Stack, path: str) -> str:
    assert stack.http_url is not None
    return stack.http_url.removesuffix("/v1") + path


# -- completions -------------------------------------------------------------------------------


def test_completion(stack: Stack) -> None:
    result = sdk(stack).completions.create(model="fake-echo", prompt="hello world", max_tokens=15)
    assert result.object == "text_completion" and result.model == SERVED_NAME
    [choice] = result.choices
    assert choice.text == echo("hello world", 15) == "hello worldhell"
    assert choice.finish_reason == "length" and choice.index == 0 and choice.logprobs is None
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (11, 15)
    assert result.usage.total_tokens == 26
    stack.assert_idle()


def test_completion_default_max_tokens_is_openais_16(stack: Stack) -> None:
    result = sdk(stack).completions.create(model="fake-echo", prompt="abc")
    assert result.choices[0].text == echo("abc", 16)
    stack.assert_idle()


def test_completion_stream_equals_non_stream(stack: Stack) -> None:
    client = sdk(stack)
    prompt = "héllo 🤖 ok "
    whole = client.completions.create(model="fake-echo", prompt=prompt, max_tokens=30, seed=3)
    chunks = list(
        client.completions.create(
            model="fake-echo",
            prompt=prompt,
            max_tokens=30,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text == echo(prompt, 30)
    assert all("\ufffd" not in c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    # include_usage: one last chunk with the usage and no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 30
    assert chunks[-1].usage.prompt_tokens == len(prompt.encode())
    assert all(c.usage is None for c in chunks[:-1])
    stack.assert_idle()


def test_n_choices_and_prompt_lists(stack: Stack) -> None:
    result = sdk(stack).completions.create(
        model="fake-echo", prompt=["ab", "xyz"], n=2, max_tokens=5
    )
    # OpenAI's order: prompt 0's n choices, then prompt 1's.
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    assert [c.text for c in result.choices] == ["ababa", "ababa", "xyzxy", "xyzxy"]
    assert result.usage is not None
    assert result.usage.prompt_tokens == 2 + 3  # each prompt once
    assert result.usage.completion_tokens == 4 * 5
    stack.assert_idle()


def test_n_choices_streamed(stack: Stack) -> None:
    chunks = list(
        sdk(stack).completions.create(
            model="fake-echo", prompt="stream me", n=3, max_tokens=12, stream=True
        )
    )
    texts = {i: "" for i in range(3)}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {i: echo("stream me", 12) for i in range(3)}
    stack.assert_idle()


def test_stop_strings(stack: Stack) -> None:
    client = sdk(stack)
    result = client.completions.create(
        model="fake-echo", prompt="abc STOP def", max_tokens=100, stop=["STOP", "zzz"]
    )
    assert result.choices[0].text == "abc " and result.choices[0].finish_reason == "stop"
    assert result.usage is not None and result.usage.completion_tokens < 100
    streamed = list(
        client.completions.create(
            model="fake-echo", prompt="abc STOP def", max_tokens=100, stop="STOP", stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == "abc "
    assert streamed[-1].choices[0].finish_reason == "stop"
    stack.assert_idle(timeout=2)


def test_completion_logprobs(stack: Stack) -> None:
    result = sdk(stack).completions.create(
        model="fake-echo", prompt="héllo", max_tokens=6, logprobs=2
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None
    # "é" is two byte tokens: each is part of a character, shown as OpenAI shows bytes.
    assert logprobs.tokens == ["h", "bytes:\\xc3", "bytes:\\xa9", "l", "l", "o"]
    assert logprobs.token_logprobs == [0.0] * 6
    # text_offset: the character offset of each token; both bytes of "é" start at 1.
    assert logprobs.text_offset == [0, 1, 1, 2, 3, 4]
    # The echo engine's top-2: the token (0.0) and the next token id (-1.0).
    assert logprobs.top_logprobs is not None
    assert logprobs.top_logprobs[0] == {"h": 0.0, "i": -1.0}
    assert logprobs.top_logprobs[3] == {"l": 0.0, "m": -1.0}
    stack.assert_idle()


# -- chat ----------------------------------------------------------------------------------------


def test_chat(stack: Stack) -> None:
    result = sdk(stack).chat.completions.create(
        model="fake-echo",
        messages=[
            {"role": "developer", "content": "be brief"},  # OpenAI's new name for system
            {
                "role": "user",
                "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}],
            },
        ],
        max_completion_tokens=100,
    )
    [choice] = result.choices
    assert result.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == "system\nbe brief"  # the echo of the rendered template
    assert choice.finish_reason == "stop"
    stack.assert_idle()


def test_chat_stream_equals_non_stream(stack: Stack) -> None:
    client = sdk(stack)
    whole = client.chat.completions.create(model="fake-echo", messages=USER)
    chunks = list(client.chat.completions.create(model="fake-echo", messages=USER, stream=True))
    assert whole.choices[0].message.content == "user\nhi"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "user\nhi"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert whole.usage is not None
    assert whole.usage.completion_tokens == 9  # <|im_start|>, "user\nhi", <|im_end|>
    stack.assert_idle()


def test_chat_logprobs(stack: Stack) -> None:
    result = sdk(stack).chat.completions.create(
        model="fake-echo", messages=USER, logprobs=True, top_logprobs=2, n=2
    )
    assert len(result.choices) == 2
    for choice in result.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        content = choice.logprobs.content
        assert [t.token for t in content][1:8] == list("user\nhi")
        assert content[1].bytes == [ord("u")] and content[1].logprob == 0.0
        assert [(t.token, t.logprob) for t in content[1].top_logprobs] == [("u", 0.0), ("v", -1.0)]
        assert content[-1].token == "<|im_end|>"
    stack.assert_idle()


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "temperature=-1.0 must be a finite number >= 0"),
        ({"top_p": 1.5}, "top_p", "top_p=1.5 must be in (0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty=2.5 must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "must be in [-2, 2]"),
        ({"n": 0}, "n", "n=0 must be in [1, 128]"),
        ({"logprobs": 21}, "logprobs", "logprobs=21 must be in [0, 20]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens=0 must be >= 1"),
        ({"max_tokens": 600}, "max_tokens", "max_tokens=600 exceeds the model's remaining"),
        ({"prompt": ""}, "prompt", "prompt is empty"),
        ({"prompt": [1, 2, 9999]}, "prompt", "prompt[2]=9999 is outside the vocabulary"),
        (
            {"extra_body": {"prompt_logprobs": 21}},
            "prompt_logprobs",
            "prompt_logprobs=21 must be in [0, 20]",
        ),
        (
            {"extra_body": {"repetition_penalty": 1.2}},
            "repetition_penalty",
            "repetition_penalty=1.2 is not supported (only 1.0)",
        ),
        ({"extra_body": {"min_tokens": 4}}, "min_tokens", "min_tokens=4 is not supported"),
        ({"temperature": "hot"}, "temperature", "temperature='hot': Input should be a valid"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "at most 16 are allowed"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", "logit_bias key 'x' is not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "logit_bias[5]=101.0 must be in [-100, 100]"),
        ({"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias key 99999 is outside the vocab"),
    ],
)
def test_invalid_completion_is_bad_request(
    stack: Stack, fields: dict[str, Any], param: str, message: str
) -> None:
    body = {"prompt": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).completions.create(model="fake-echo", **body)
    assert err.value.status_code == 400
    assert err.value.type == "invalid_request_error"
    assert err.value.param == param
    assert message in err.value.message


@pytest.mark.parametrize(
    ("fields", "param", "message"),
    [
        ({"messages": []}, "messages", "messages is empty"),
        (
            {"messages": [{"role": "wizard", "content": "hi"}]},
            "messages",
            "messages[0].role='wizard'",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs=3 needs logprobs=true"),
        (
            {"extra_body": {"prompt_logprobs": -1}},
            "prompt_logprobs",
            "prompt_logprobs=-1 must be in [0, 20]",
        ),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "must be in [0, 20]"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
            "tool_choice.function.name='g' is not one of the tools (f)",
        ),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with"),
        ({"messages": [{"role": "user"}]}, "messages", "messages[0].content is missing"),
        ({"messages": [{"content": "hi"}]}, "messages", "messages[0].role is required"),
        (
            {"messages": [USER[0], {"role": "user", "content": 5}]},
            "messages",
            "messages[1].content=5: ",
        ),
    ],
)
def test_invalid_chat_is_bad_request(
    stack: Stack, fields: dict[str, Any], param: str, message: str
) -> None:
    body = {"messages": USER, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).chat.completions.create(model="fake-echo", **body)
    assert err.value.param == param
    assert message in err.value.message


def test_what_sdks_and_proxies_send(stack: Stack) -> None:
    """Explicit nulls are the fields' defaults (OpenAI's schema marks them nullable); a prompt
    past the context is context_length_exceeded in OpenAI's words, which litellm maps to its
    ContextWindowExceededError; ids past int32 and malformed assistant calls are 400s naming
    the field (they were 500s)."""
    nulls = {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None,
             "temperature": None, "stop": None, "tool_choice": None,
             # vLLM's no-op defaults (other values are refused: not supported yet)
             "repetition_penalty": 1.0, "min_tokens": 0, "prompt_logprobs": None}  # fmt: skip
    reply = sdk(stack).chat.completions.create(
        model="fake-echo", messages=USER, max_tokens=3, extra_body=nulls
    )
    assert len(reply.choices) == 1 and reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).completions.create(model="fake-echo", prompt="x" * 600, max_tokens=3)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert "This model's maximum context length is 512 tokens" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).completions.create(model="fake-echo", prompt="x" * 100, max_tokens=500)
    assert err.value.code == "context_length_exceeded"
    for big in (2**31, 2**63):
        with pytest.raises(openai.BadRequestError) as err:
            sdk(stack).completions.create(model="fake-echo", prompt=[5, big], max_tokens=2)
        assert f"prompt[1]={big} is not a token id" in err.value.message
    turn = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": "f"}]}
    with pytest.raises(openai.BadRequestError) as err:
        sdk(stack).chat.completions.create(
            model="fake-echo",
            messages=[USER[0], turn],
            max_tokens=2,  # type: ignore[list-item]
        )
    assert "messages[1].tool_calls[0].function must be an object" in err.value.message


def test_invalid_body_is_400_not_422(stack: Stack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    url = f"{stack.http_url}/completions"
    reply = httpx2.post(url, content=b"{not json", headers=headers)
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]
    reply = httpx2.post(url, json={"max_tokens": 3}, headers=headers)
    assert reply.status_code == 400
    assert reply.json()["error"] == {
        "message": "prompt is required",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    # Unknown fields are ignored, as OpenAI ignores them.
    reply = httpx2.post(
        url, json={"prompt": "ok", "max_tokens": 2, "frobnicate": 1}, headers=headers
    )
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "ok"


def test_api_key_required_on_both_apis(stack: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        sdk(stack, api_key="wrong").completions.create(model="fake-echo", prompt="hi")
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    reply = httpx2.get(f"{stack.http_url}/models")  # no Authorization at all
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    with Client(stack.gateway_address) as client, pytest.raises(grpc.RpcError) as rpc_err:
        client.generate(make_request(text="hi", max_tokens=2))
    assert rpc_err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(stack.gateway_address, api_key="wrong") as client, pytest.raises(grpc.RpcError):
        client.model_info()
    # The right key works on gRPC too; health checks need none.
    with stack.client() as client:
        assert client.generate(make_request(text="hi", max_tokens=2)).text == "hi"
    assert httpx2.get(root_url(stack, "/health")).status_code == 200
    assert httpx2.get(root_url(stack, "/ready")).json() == {"status": "ready"}


def test_models_and_openapi(stack: Stack) -> None:
    client = sdk(stack)
    model, alias = client.models.list().data  # the id, then its alias
    assert (model.id, alias.id) == (SERVED_NAME, "fake-echo") and model.object == "model"
    assert client.models.retrieve(SERVED_NAME).id == SERVED_NAME
    with stack.client() as grpc_client:
        assert grpc_client.model_info().model == SERVED_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    card = httpx2.get(f"{stack.http_url}/models", headers=AUTH).json()["data"][0]
    assert card["root"] and (card["parent"], card["max_model_len"]) == (None, 512)
    # A name that is neither the id nor an alias (fake-echo) is 404 model_not_found, as vLLM.
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert client.completions.create(model="fake-echo", prompt="hi", max_tokens=2).choices
    metrics = httpx2.get(root_url(stack, "/metrics")).text  # aiperf looks for it here
    assert "llmserve_gateway" in metrics or "gen_ai" in metrics, metrics[:500]
    document = httpx2.get(root_url(stack, "/openapi.json")).json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(document["paths"])
    assert "CompletionRequest" in document["components"]["schemas"]


# -- hostile input -------------------------------------------------------------------------------


def post_json(stack: Stack, path: str, body: object) -> httpx2.Response:
    """POST body as JSON text Python writes (a lone surrogate goes out as a \\ud800 escape)."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    return httpx2.post(f"{stack.http_url}{path}", content=json.dumps(body), headers=headers)


@pytest.mark.parametrize(
    ("path", "fields", "message"),
    [
        ("/completions", {"prompt": "a\ud800b"}, "prompt is not valid Unicode: lone surrogate"),
        ("/completions", {"prompt": ["ok", "\udcff"]}, "prompt[1] is not valid Unicode"),
        ("/completions", {"prompt": "hi", "stop": "\ud800"}, "stop is not valid Unicode"),
        ("/completions", {"prompt": "hi", "stop": ["x", "\udfff"]}, "stop[1] is not valid"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content is not valid Unicode",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]},
            "messages[0].content[0].text is not valid Unicode",
        ),
        (
            "/chat/completions",
            {"messages": [{"role": "\ud800", "content": "hi"}]},
            "messages[0].role is not valid Unicode",
        ),
    ],
)
def test_lone_surrogates_are_bad_requests(
    stack: Stack, path: str, fields: dict[str, Any], message: str
) -> None:
    """JSON can escape half a UTF-16 pair; protobuf (UTF-8) cannot carry it: 400, not 500."""
    reply = post_json(stack, path, {"max_tokens": 2, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(message), error
    assert "U+D" in error["message"] and "at character" in error["message"]
    assert error["param"] == message.split("[")[0].split(" ")[0]
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64, 2**70])
def test_seed_out_of_range_is_bad_request(stack: Stack, seed: int) -> None:
    reply = post_json(stack, "/completions", {"prompt": "hi", "max_tokens": 2, "seed": seed})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "seed"
    assert reply.json()["error"]["message"] == str(err_seed(seed))


def err_seed(seed: int) -> str:
    """The one message for a seed out of range (common/sampling.py), as the CLI prints it too."""
    from llmserve.common.sampling import SamplingError, seed_value

    with pytest.raises(SamplingError) as err:
        seed_value(seed)
    return str(err.value)


def raw_http(stack: Stack, head: str, chunks: Iterator[bytes]) -> tuple[int, dict[str, Any]]:
    """Send a request's head and then its body chunks on a plain socket, as slowly as the server
    reads them; stop sending once the server answers (or closes); return (status, JSON body)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(str(stack.http_url))
    assert url.hostname is not None and url.port is not None
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(head.encode("latin-1"))
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: read what it said
        reply = b""
        while data := sock.recv(65536):
            reply += data
            head_end = reply.find(b"\r\n\r\n")
            if head_end >= 0 and b"content-length" in reply[:head_end].lower():
                length = int(reply[:head_end].lower().split(b"content-length: ")[1].split(b"\r")[0])
                if len(reply) >= head_end + 4 + length:
                    break
    status = int(reply.split(b" ", 2)[1])
    return status, json.loads(reply[reply.find(b"\r\n\r\n") + 4 :])


def while_polling_health(stack: Stack, work: Callable[[], T]) -> tuple[T, float]:
    """work's result, and the longest /health took while work ran (polled every 20 ms)."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx2.get(root_url(stack, "/health"), timeout=30).status_code == 200
            latencies.append(time.monotonic() - start)
            done.wait(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        result = work()
    finally:
        done.set()
        poller.join()
    return result, max(latencies)


def test_request_body_over_the_limit_is_413(stack: Stack) -> None:
    """Refused from Content-Length alone (the body is never read), and while a chunked upload
    streams in, before any JSON parsing; /health answers promptly all the while."""
    limit = 8 << 20  # GatewayConfig.max_request_bytes' default
    auth = f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}"
    status, body = raw_http(stack, head + f"Content-Length: {52_000_000}\r\n\r\n", iter([]))
    assert status == 413
    assert body["error"]["message"] == (
        f"the request body has 52000000 bytes; the limit is {limit} (max_request_bytes)"
    )
    assert body["error"]["type"] == "invalid_request_error"

    def chunked(total: int, size: int = 1 << 20) -> Iterator[bytes]:
        for data in [b'{"prompt": "'] + [b"x" * size] * (total // size):
            yield f"{len(data):x}\r\n".encode() + data + b"\r\n"
        yield b"0\r\n\r\n"

    upload = head + "Transfer-Encoding: chunked\r\n\r\n"
    (status, body), stall = while_polling_health(
        stack, lambda: raw_http(stack, upload, chunked(52 << 20))
    )
    assert status == 413
    assert body["error"]["message"] == (
        f"the request body has more than {limit} bytes; the limit is {limit} (max_request_bytes)"
    )
    assert stall < 0.6, stall
    # Just under the limit is parsed as usual.
    reply = post_json(stack, "/completions", {"prompt": "x" * (limit - 100), "max_tokens": 2})
    assert (
        reply.status_code == 400 and "characters; the limit is" in reply.json()["error"]["message"]
    )


def test_long_prompt_leaves_the_event_loop_running(stack: Stack) -> None:
    """The longest prompt allowed (1M characters) takes a second to tokenize: on a worker
    thread, with the GIL released, while /health and other requests carry on."""
    big = {"prompt": "hello world " * 87_381, "max_tokens": 1}
    reply, stall = while_polling_health(stack, lambda: post_json(stack, "/completions", big))
    assert reply.status_code == 400 and "tokens; the limit is" in reply.json()["error"]["message"]
    assert stall < 0.6, stall


def test_grpc_request_over_the_limit_is_refused(stack: Stack) -> None:
    with stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(make_request(text="x" * (9 << 20), max_tokens=2))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(8 << 20) in (err.value.details() or "")


def test_gateway_log_is_json_lines_only(stack: Stack) -> None:
    """uvicorn's own lines (server started, a request that failed) go through the same JSON
    logging as ours: a log collector reading the stream never meets a plain-text line."""
    import socket

    host, port = root_url(stack, "").removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")  # uvicorn logs "Invalid HTTP request"
        sock.recv(1024)
    assert stack.log_dir is not None
    lines = (stack.log_dir / "gateway.log").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    uvicorn = [r for r in records if r.get("logger", "").startswith("uvicorn")]
    assert any("Invalid HTTP request" in r["event"] for r in uvicorn), lines
    assert all(r["service"] == "gateway" and "level" in r for r in uvicorn)


# -- disconnects ---------------------------------------------------------------------------------


def test_disconnect_mid_stream_frees_blocks(stack: Stack) -> None:
    stream = sdk(stack).completions.create(
        model="fake-echo", prompt="cancel me " * 8, max_tokens=400, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert stack.stats().num_running == 1
    stream.close()  # drops the connection
    stack.assert_idle(timeout=1.0)


def test_disconnect_while_waiting_frees_blocks(stack: Stack) -> None:
    """A non-streamed request whose client gives up (timeout) is aborted too, all n choices."""
    client = sdk(stack, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="fake-echo", prompt="slow " * 8, n=3, max_tokens=400)
    stack.assert_idle(timeout=1.0)


# -- gRPC gets the new fields too --------------------------------------------------------------


def test_grpc_top_logprobs_and_penalties(stack: Stack) -> None:
    request = make_request(
        text="abc", max_tokens=4, logprobs=True, top_logprobs=3, presence_penalty=0.5
    )
    with stack.client() as client:
        messages = list(client.stream(request))
    token_ids = [t for m in messages for t in m.token_ids]
    tops = [t for m in messages for t in m.top_logprobs]
    assert token_ids == [97, 98, 99, 97]
    assert [list(t.token_ids) for t in tops] == [[t, t + 1, t + 2] for t in token_ids]
    assert [list(t.logprobs) for t in tops] == [[0.0, -1.0, -2.0]] * 4
    stack.assert_idle()


# -- admission -----------------------------------------------------------------------------------


def test_full_queue_is_429_with_retry_after(tokenizer_dir: Path, tmp_path: Path) -> None:
    s = _echo_stack(
        tokenizer_dir,
        tmp_path,
        "--fake-step-delay-ms",
        "20",
        scheduler=("--max-num-seqs", "1", "--max-waiting", "1"),
    )
    try:
        client = sdk(s)

        def one(i: int) -> object:
            try:
                return client.completions.create(
                    model="fake-echo", prompt=f"q{i}", max_tokens=20, stream=i % 2 == 0
                )
            except openai.RateLimitError as err:
                return err

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        refused = [r for r in results if isinstance(r, openai.RateLimitError)]
        assert refused, "no request was refused"
        assert len(refused) < len(results), "every request was refused"
        for err in refused:
            assert err.status_code == 429
            assert err.response.headers["retry-after"] == "1"
            assert "queue full" in err.message
        for r in results:
            if isinstance(r, openai.Stream):
                list(r)  # finish the streams that were admitted
        # More choices than the queue can ever hold: retrying cannot help, so 400, not 429.
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model="fake-echo", prompt=["a", "b"], n=1, max_tokens=2)
        assert bad.value.param == "n"
        assert "n=1 times 2 prompts is 2 choices; the scheduler queues at most 1" in str(
            bad.value.message
        )
        with pytest.raises(openai.BadRequestError, match=r"n=2 .*max_waiting=1"):
            client.chat.completions.create(model="fake-echo", messages=USER, n=2)
        s.assert_idle()
    finally:
        s.close()


def test_not_ready_is_503(tokenizer_dir: Path, tmp_path: Path) -> None:
    """A gateway whose scheduler is not there: alive, not ready, requests 503 with Retry-After."""
    from llmserve.stack import local_stack
    from tests.stack import service_configs

    (gateway,) = service_configs("gateway", ["--model", str(tokenizer_dir)])
    alone = local_stack(gateway=gateway, http=True, log_dir=tmp_path)
    alone.start(("gateway",))  # no scheduler behind it
    base = str(alone.http_url).removesuffix("/v1")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx2.get(f"{base}/health").json() == {"status": "ok"}
                break
            except httpx2.TransportError:
                assert time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
                time.sleep(0.1)
        ready = httpx2.get(f"{base}/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="fake-echo", prompt="hi")
        assert err.value.status_code == 503
        assert "scheduler not connected" in err.value.message
    finally:
        alone.stop()


# -- the tiny random model: real sampling ------------------------------------------------------


@pytest.fixture(scope="module")
def model_stack(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    s = start_stack(
        tiny_model(num_heads=4, num_kv_heads=2),
        engine_args=["--num-kv-blocks", "128", "--num-threads", "1"],
        http=True,
        log_dir=tmp_path_factory.mktemp("logs"),
    )
    yield s
    s.close()


def test_streamed_text_equals_non_streamed_for_a_seed(model_stack: Stack) -> None:
    client = sdk(model_stack)
    fields: dict[str, Any] = {
        "model": "fake-echo",
        "max_tokens": 16,
        "temperature": 1.0,
        "seed": 1234,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(prompt="the quick brown fox", **fields)
    streamed = client.completions.create(prompt="the quick brown fox", stream=True, **fields)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    chat = client.chat.completions.create(messages=USER, **fields)
    chat_stream = client.chat.completions.create(messages=USER, stream=True, **fields)
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text == chat.choices[0].message.content
    model_stack.assert_idle()


def test_seeded_choices_differ_and_reproduce(model_stack: Stack) -> None:
    client = sdk(model_stack)
    fields: dict[str, Any] = {
        "model": "fake-echo",
        "prompt": "once upon a time",
        "max_tokens": 12,
        "temperature": 1.5,
        "seed": 99,
        "extra_body": {"ignore_eos": True},
    }
    first = [c.text for c in client.completions.create(n=3, **fields).choices]
    again = [c.text for c in client.completions.create(n=3, **fields).choices]
    alone = client.completions.create(**fields).choices[0].text
    assert first == again
    assert len(set(first)) == 3, first
    assert first[0] == alone  # choice 0 keeps the request's own seed
    model_stack.assert_idle()


def test_tiny_temperature_is_greedy_on_a_model(model_stack: Stack) -> None:
    """A temperature below common.sampling.MIN_TEMPERATURE samples as greedy: the argmax tokens,
    not a softmax of logits / 1e-38 that overflows to NaN (and then token 0 every time)."""
    client = sdk(model_stack)
    fields: dict[str, Any] = {
        "model": "fake-echo",
        "prompt": "the quick brown fox",
        "max_tokens": 12,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    greedy = client.completions.create(temperature=0.0, **fields).choices[0]
    for temperature in (1e-38, 1e-30, 1e-6):
        tiny = client.completions.create(temperature=temperature, seed=5, **fields).choices[0]
        assert tiny.text == greedy.text, temperature
    assert greedy.logprobs is not None
    assert len(set(greedy.logprobs.tokens)) > 1  # not one token repeated
    model_stack.assert_idle()


def test_penalties_and_top_logprobs_on_a_model(model_stack: Stack) -> None:
    client = sdk(model_stack)
    fields: dict[str, Any] = {
        "model": "fake-echo",
        "messages": USER,
        "max_tokens": 24,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 5,
        "extra_body": {"ignore_eos": True},
    }
    plain = client.chat.completions.create(**fields).choices[0]
    assert plain.logprobs is not None and plain.logprobs.content is not None
    for token in plain.logprobs.content:
        # Greedy: the chosen token is the most likely one, with the same logprob.
        assert len(token.top_logprobs) == 5
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob
        assert [t.logprob for t in token.top_logprobs] == sorted(
            (t.logprob for t in token.top_logprobs), reverse=True
        )
    penalized = client.chat.completions.create(frequency_penalty=2.0, **fields).choices[0]
    assert penalized.logprobs is not None and penalized.logprobs.content is not None
    plain_tokens = [t.token for t in plain.logprobs.content]
    penalized_tokens = [t.token for t in penalized.logprobs.content]
    assert penalized_tokens != plain_tokens
    # The most repeated token repeats less once each repetition costs 2 logits.
    assert max(map(penalized_tokens.count, penalized_tokens)) < max(
        map(plain_tokens.count, plain_tokens)
    )
    model_stack.assert_idle()


def test_logit_bias_on_a_model(model_stack: Stack) -> None:
    """Greedy with +100 on one token writes only it, on both endpoints; -100 on the token greedy
    picks first makes it pick another."""
    client = sdk(model_stack)
    [z] = post_json(model_stack, "/../tokenize", {"prompt": "z"}).json()["tokens"]
    fields: dict[str, Any] = {"model": "fake-echo", "max_tokens": 4, "temperature": 0.0,
                              "extra_body": {"ignore_eos": True}}  # fmt: skip
    forced = client.completions.create(prompt="hello", logit_bias={str(z): 100}, **fields)
    assert forced.choices[0].text == "zzzz"
    chat = client.chat.completions.create(messages=USER, logit_bias={str(z): 100}, **fields)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == "zzzz"
    plain = client.completions.create(prompt="hello", logprobs=0, **fields).choices[0]
    assert plain.logprobs is not None and plain.logprobs.tokens
    [first] = post_json(model_stack, "/../tokenize", {"prompt": plain.logprobs.tokens[0]}).json()[
        "tokens"
    ]
    banned = client.completions.create(prompt="hello", logit_bias={str(first): -100}, **fields)
    assert not banned.choices[0].text.startswith(plain.logprobs.tokens[0])


def test_forced_call_is_one_call_and_never_content(model_stack: Stack) -> None:
    """A named tool_choice (parallel_tool_calls left at its default, true) gives at most one
    call, and no tool markup reaches content: answered whole or cut by max_tokens, streamed or
    not (random weights: what the grammar admits is all that is sure)."""
    client = sdk(model_stack)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}}}  # fmt: skip
    named = {"type": "function", "function": {"name": "f"}}
    fields: dict[str, Any] = {"model": "any", "messages": USER, "tools": [tool], "seed": 3,
                              "tool_choice": named}  # fmt: skip
    reasons = set()
    for max_tokens in (6, 60):
        [choice] = client.chat.completions.create(max_tokens=max_tokens, **fields).choices
        assert not choice.message.content, choice.message.content
        assert len(choice.message.tool_calls or []) <= 1
        reasons.add(choice.finish_reason)
        chunks = list(client.chat.completions.create(max_tokens=max_tokens, stream=True, **fields))
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) <= 1
    assert "length" in reasons  # the cut case was met
    model_stack.assert_idle()


def test_model_id_defaults_to_the_model_directory_name(
    model_stack: Stack, tiny_model: Callable[..., Path]
) -> None:
    directory = tiny_model(num_heads=4, num_kv_heads=2)
    [model] = sdk(model_stack).models.list().data
    assert model.id == directory.name
    with model_stack.client() as client:
        assert client.model_info().model == directory.name


# -- units: the protocol's own checks ----------------------------------------------------------


def test_choice_seed() -> None:
    assert choice_seed(42, 0) == 42
    seeds = {choice_seed(42, i) for i in range(1, 100)}
    assert len(seeds) == 99 and 42 not in seeds
    assert all(0 <= s < 2**64 for s in seeds)
    assert choice_seed(2**64 - 1, 5) == choice_seed(2**64 - 1, 5)


def test_http_field_names() -> None:
    assert http_message("text is empty", "prompt") == ("prompt is empty", "prompt")
    assert http_message("chat.messages[1].role='x' must be", "messages") == (
        "messages[1].role='x' must be",
        "messages",
    )
    assert http_message("prompt has 70 tokens; the limit is 63", "messages")[1] == "messages"
    assert http_message("top_p=1.5 must be in (0, 1]", "prompt")[1] == "top_p"


def test_completion_request_conversion() -> None:
    [req] = completion_requests(
        CompletionRequest(prompt="hi", logprobs=3, seed=-1, stop="x", top_k=5)
    )
    assert req.text == "hi" and req.max_tokens == 16
    p = req.sampling
    assert p.logprobs and p.top_logprobs == 3
    assert p.seed == 2**64 - 1  # OpenAI's int64 seeds, as our uint64
    assert make_request(text="hi", seed=-1).sampling.seed == p.seed  # one rule for both APIs
    assert list(req.stop) == ["x"] and p.top_k == 5
    assert not p.HasField("temperature")  # unset stays unset: the server's default
    with pytest.raises(ValidationError, match="129 choices; the limit is 128"):
        completion_requests(CompletionRequest(prompt=["a"] * 43, n=3))


def test_chat_request_conversion() -> None:
    body = ChatCompletionRequest(
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        max_tokens=5,
        max_completion_tokens=7,
        response_format={"type": "text"},
    )
    req = chat_request(body)
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "s"), ("user", "u")]
    assert req.max_tokens == 7  # max_completion_tokens wins
    body = ChatCompletionRequest(messages=USER, response_format={"type": "json_object"})
    assert chat_request(body).sampling.structured_output.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    req = chat_request(ChatCompletionRequest(messages=USER, response_format=fmt))
    assert json.loads(req.sampling.structured_output.json_schema) == schema
    body = ChatCompletionRequest(messages=USER, response_format={"type": "xml"})
    with pytest.raises(ValidationError, match=r"response_format\.type='xml' must be"):
        chat_request(body)
    [req] = completion_requests(
        CompletionRequest(prompt=[5, 6], structured_outputs={"choice": ["a", "b"]})
    )
    assert list(req.token_ids.ids) == [5, 6]
    assert list(req.sampling.structured_output.choice.choices) == ["a", "b"]


def test_error_event_shape() -> None:
    """An error after a stream's 200 is an event the openai SDK raises as APIError."""
    from llmserve.gateway.errors import GatewayError
    from llmserve.gateway.http_errors import ApiError

    event = ApiError.from_gateway(GatewayError(grpc.StatusCode.INTERNAL, "boom"), "prompt")
    assert json.loads(event.body.model_dump_json()) == {
        "error": {
            "message": "boom",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert event.status == 500


def test_default_model_id(tmp_path: Path) -> None:
    from llmserve.common.model_config import default_model_id

    assert default_model_id(None) == default_model_id("builtin") == "SmolLM2-135M-Instruct"
    assert default_model_id("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert default_model_id("/models/Llama-3-8B/") == "Llama-3-8B"
    assert default_model_id("/models/Llama-3-8B/config.json") == "Llama-3-8B"
    assert default_model_id(str(tmp_path / "a" / "..")) == tmp_path.name


# -- what real clients send (issue 37) ----------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f"}}


def _assistant_calls(calls: list[Any]) -> list[dict[str, Any]]:
    return [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/chat/completions", {"messages": _assistant_calls([{"id": "c"}])},
         "messages[1].tool_calls[0].function must be an object"),
        ("/chat/completions", {"messages": _assistant_calls([{"function": "f"}])},
         "messages[1].tool_calls[0].function must be an object"),
        ("/chat/completions", {"messages": _assistant_calls([{"function": {"arguments": "{}"}}])},
         "messages[1].tool_calls[0].function.name must be"),
        ("/chat/completions",
         {"messages": _assistant_calls([{"function": {"name": "f", "arguments": 5}}])},
         "messages[1].tool_calls[0].function.arguments must be a string"),
        ("/completions", {"prompt": [1, 2**31]}, "prompt[1]=2147483648 is not a token id"),
        ("/completions", {"prompt": [[1], [2**63]]}, "prompt[1][0]=9223372036854775808 is not"),
        ("/chat/completions",
         {"messages": USER, "tool_choice": "required", "tools": [
             TOOL, {"type": "function", "function": {"name": "g", "parameters": {"type": 7}}}]},
         "tools[1].function.parameters does not compile"),
        ("/chat/completions",  # parameters no value satisfies: a 400, not an empty success
         {"messages": USER, "tool_choice": "required", "tools": [
             TOOL, {"type": "function", "function": {"name": "g", "parameters": {"$ref": "#"}}}]},
         "tools[1].function.parameters does not compile: its language is empty"),
    ],
)  # fmt: skip
def test_hostile_input_is_a_400_naming_the_field(
    stack: Stack, path: str, body: dict[str, Any], message: str
) -> None:
    """Each of these was a 500 (KeyError, TypeError, 'Value out of range') or named our grammar;
    the gateway serves on after each."""
    reply = post_json(stack, path, {"max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(message) and error["type"] == "invalid_request_error"
    assert error["param"] == message.split("[")[0].split(".")[0]
    assert "%json" not in error["message"]
    after = sdk(stack).completions.create(model="fake-echo", prompt="ok", max_tokens=2)
    assert after.choices[0].text


def test_grpc_bad_tool_call_is_invalid_argument(stack: Stack) -> None:
    req = make_request(messages=[("user", "hi"), ("assistant", "")], max_tokens=2)
    req.chat.messages[1].tool_calls_json = json.dumps([{"function": "f"}])
    with stack.client() as client, pytest.raises(grpc.RpcError) as err:
        client.generate(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.messages[1].tool_calls[0].function" in (err.value.details() or "")


def test_explicit_nulls_mean_the_defaults(stack: Stack) -> None:
    nulls = {"n": None, "stream": None, "logprobs": None, "stream_options": None}
    reply = post_json(stack, "/completions", {"prompt": "hey", "max_tokens": 3, "echo": None,
                                              **nulls})  # fmt: skip
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == "hey"
    chat = {"messages": USER, "max_tokens": 2, "parallel_tool_calls": None, "tools": None,
            "tool_choice": None, "top_logprobs": None, **nulls}  # fmt: skip
    reply = post_json(stack, "/chat/completions", chat)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 1
    streamed = {"prompt": "hey", "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": None}}  # fmt: skip
    reply = post_json(stack, "/completions", streamed)
    assert reply.status_code == 200 and reply.text.rstrip().endswith("data: [DONE]")


def test_context_overflow_has_openais_code(stack: Stack) -> None:
    """litellm and others read code context_length_exceeded or OpenAI's wording as a context
    overflow (their fallbacks hang on it): for a long prompt and for max_tokens past it."""
    for body in ({"prompt": "x" * 600}, {"prompt": "x" * 10, "max_tokens": 600}):
        with pytest.raises(openai.BadRequestError) as err:
            sdk(stack).completions.create(model="fake-echo", **body)
        assert err.value.code == "context_length_exceeded"
        assert err.value.type == "invalid_request_error"
        assert "This model's maximum context length is 512 tokens" in err.value.message


def test_models_carry_vllms_fields(stack: Stack) -> None:
    """`vllm bench serve` reads data[0]["root"] (its tokenizer) and max_model_len."""
    model, _alias = httpx2.get(f"{stack.http_url}/models", headers=AUTH).json()["data"]
    assert model["root"] and model["parent"] is None
    assert model["max_model_len"] == 512  # the stack's --max-model-len


def test_tokenize_counts_what_a_request_uses(stack: Stack) -> None:
    """/tokenize's count is the prompt_tokens a completion / chat completion of the same prompt
    reports; /detokenize gives the text back; bad input is a 400 naming the field."""
    text = "tokens, please"
    ids = post_json(stack, "/../tokenize", {"prompt": text}).json()
    done = sdk(stack).completions.create(model="fake-echo", prompt=text, max_tokens=1)
    assert done.usage is not None and ids["count"] == done.usage.prompt_tokens == len(ids["tokens"])
    assert ids["max_model_len"] == 512
    back = post_json(stack, "/../detokenize", {"tokens": ids["tokens"]}).json()
    assert back == {"prompt": text}
    chat_ids = post_json(stack, "/../tokenize", {"messages": USER}).json()
    chat = sdk(stack).chat.completions.create(
        model="fake-echo",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert chat.usage is not None and chat_ids["count"] == chat.usage.prompt_tokens
    for path, body, param in (
        ("/../tokenize", {}, "prompt"),
        ("/../tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ("/../detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ):
        reply = post_json(stack, path, body)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.fixture(scope="module")
def strict_stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_echo_stack(
        tokenizer_dir,
        tmp_path_factory.mktemp("logs"),
        gateway_args=["--served-model-name", "main", "other-name"],
        http=True,
        accept_any_model=False,  # the default: strict
    )
    yield s
    s.close()


def test_strict_model_names_and_aliases(strict_stack: Stack) -> None:
    """--served-model-name's names all reach the base model (the first is its id, and each is
    listed); any other is 404 model_not_found naming them (without --accept-any-model)."""
    client = openai.OpenAI(base_url=strict_stack.http_url, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["main", "other-name"]
    for name in ("main", "other-name"):
        done = client.completions.create(model=name, prompt="ok", max_tokens=2)
        assert done.choices[0].text == "ok" and done.model == "main"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)  # type: ignore[arg-type]
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert "'gpt-4o' is not served here; models: main, other-name" in err.value.message


def test_earlier_calls_with_object_or_text_arguments_are_served(stack: Stack) -> None:
    """An assistant turn's call arguments as OpenAI's JSON text or as an object (some clients
    send one; it was a 500) both render; the tool's answer follows."""
    for arguments in ('{"a": 1}', {"a": 1}):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [*_assistant_calls([call]), {"role": "tool", "tool_call_id": "c1",
                                                "content": "2"}]  # fmt: skip
        reply = post_json(stack, "/chat/completions", {"messages": messages, "max_tokens": 2})
        assert reply.status_code == 200, reply.text


def test_an_image_content_part_is_a_bad_request(stack: Stack) -> None:
    """Image input (a vision-language checkpoint served as its text model, Qwen3.5's): a 400
    naming the part, not silently dropped."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    content = [{"type": "text", "text": "what is this?"}, image]
    reply = post_json(
        stack,
        "/chat/completions",
        {"max_tokens": 2, "messages": [{"role": "user", "content": content}]},
    )
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("messages[0].content[1].type='image_url' is not supported"), message
