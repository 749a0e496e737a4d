"""The OpenAI surface driven by the clients people point at an OpenAI-compatible server
(langchain-openai, litellm), on one shared echo stack: what each client needs the server to send
is read from the client's own parsed objects, not from our JSON.

The echo engine answers a chat with the rendered prompt's bytes: for USER the content is
"user\\nhi", then its EOS (finish reason "stop"); tests/test_openai_api.py explains the echo.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

# litellm fetches its model price list from the internet at import unless told to use its copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_openai import ChatOpenAI

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
        "256",
        "--num-kv-blocks",
        "64",
        http=True,
    )
    yield s
    s.close()


def url(stack: Stack) -> str:
    assert stack.http_url is not None
    return stack.http_url


def prompt_tokens(stack: Stack) -> int:
    """USER's prompt length, from the server's /tokenize."""
    body = {"messages": [{"role": "user", "content": "hi"}]}
    return int(httpx2.post(url(stack).removesuffix("/v1") + "/tokenize", json=body).json()["count"])


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
        ([{"role": "user", "content": "x" * 400}], 8),
        ([{"role": "user", "content": "hi"}], 400),
    ):
        with pytest.raises(litellm.ContextWindowExceededError):
            litellm.completion(messages=messages, max_tokens=max_tokens, **litellm_fields(stack))
    with pytest.raises(litellm.BadRequestError) as err:
        litellm.completion(
            messages=[{"role": "user", "content": "hi"}], top_p=7.0, **litellm_fields(stack)
        )
    assert not isinstance(err.value, litellm.ContextWindowExceededError)
