"""A small synchronous client for the gateway's Generation API (used by the CLI, tests, bench)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from common.net import CHANNEL_OPTIONS
from protos import api_pb2, api_pb2_grpc, common_pb2

FINISH_REASON_NAMES = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0

    def add(self, msg: api_pb2.GenerateResponse) -> None:
        self.text += msg.text
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        if msg.finish_reason:
            self.finish_reason = FINISH_REASON_NAMES[msg.finish_reason]
            self.prompt_tokens = msg.usage.prompt_tokens
            self.completion_tokens = msg.usage.completion_tokens
            self.cached_prompt_tokens = msg.usage.cached_prompt_tokens

    def to_json(self) -> dict[str, object]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cached_prompt_tokens": self.cached_prompt_tokens,
            },
        }


def make_request(
    text: str | None = None,
    messages: list[tuple[str, str]] | None = None,
    **fields: object,
) -> api_pb2.GenerateRequest:
    """A GenerateRequest from a text prompt or (role, content) messages; unset fields (None)
    keep the server's defaults. Fields of common.SamplingParams (temperature, seed, ...) go into
    `sampling`, the others (max_tokens, stop, ...) into the request itself."""
    sampling_names = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    given = {k: v for k, v in fields.items() if v is not None}
    req = api_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(
            **{k: v for k, v in given.items() if k in sampling_names}
        ),
        **{k: v for k, v in given.items() if k not in sampling_names},
    )
    if messages is not None:
        req.chat.messages.extend(api_pb2.ChatMessage(role=r, content=c) for r, c in messages)
    elif text is not None:
        req.text = text
    return req


class Client:
    def __init__(self, address: str, api_key: str | None = None):
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = api_pb2_grpc.GenerationStub(self.channel)
        # Sent with every call when the gateway requires a key (`llmserve gateway --api-key`).
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def start(self, request: api_pb2.GenerateRequest, timeout: float | None = None) -> Any:
        """The Generate call: iterating it yields the response messages (grpc.RpcError on
        refusal); cancel(), from any thread or a signal handler, ends it, and the server frees
        the request's blocks (the iteration then raises grpc.RpcError CANCELLED)."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def stream(
        self, request: api_pb2.GenerateRequest, timeout: float | None = None
    ) -> Iterator[api_pb2.GenerateResponse]:
        """The response messages as they arrive; raises grpc.RpcError on refusal. Closing the
        iterator early cancels the request."""
        call = self.start(request, timeout)
        try:
            yield from call
        finally:
            call.cancel()  # no-op once finished

    def generate(
        self, request: api_pb2.GenerateRequest, timeout: float | None = None
    ) -> Completion:
        completion = Completion()
        for msg in self.stream(request, timeout):
            completion.add(msg)
        return completion

    def model_info(self, timeout: float = 5.0) -> api_pb2.ModelInfo:
        return self.stub.GetModelInfo(
            api_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata
        )
