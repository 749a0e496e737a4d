"""A small synchronous client for the gateway's Generation API (used by the CLI, tests, bench)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from llmserve.common.auth import bearer_metadata
from llmserve.common.net import CHANNEL_OPTIONS, DEFAULT_GATEWAY_PORT, with_default_port
from llmserve.common.sampling import SamplingError, seed_value
from llmserve.common.text import invalid_text
from llmserve.protos import api_pb2, api_pb2_grpc, common_pb2


def finish_reason_name(value: int) -> str:
    """FINISH_REASON_STOP -> "stop", the names the HTTP API uses."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


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
            self.finish_reason = finish_reason_name(msg.finish_reason)
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


class RequestError(ValueError):
    """A value make_request cannot send: text that is not valid Unicode, a number outside its
    field's range. The message names the field, the value and the limit."""


def _text(where: str, value: str) -> str:
    # Text from the command line keeps bytes that are not UTF-8 as surrogates: name the byte.
    why = invalid_text(value, from_bytes=True)
    if why is not None:
        raise RequestError(f"{where} is {why}")
    return value


def _checked(where: str, int32: bool, value: object) -> object:
    if isinstance(value, str):
        return _text(where, value)
    if int32 and isinstance(value, int):
        low, high = -(2**31), 2**31 - 1
        if not low <= value <= high:
            raise RequestError(f"{where}={value} is outside the int32 range [{low}, {high}]")
    return value


def _set(msg: Message, name: str, value: object) -> None:
    field = msg.DESCRIPTOR.fields_by_name.get(name)
    if field is None:
        raise RequestError(f"{name} is not a field of {msg.DESCRIPTOR.name}")
    if name == "seed" and isinstance(value, int):
        try:
            value = seed_value(value)
        except SamplingError as err:
            raise RequestError(str(err)) from None
    int32 = field.type == FieldDescriptor.TYPE_INT32
    if isinstance(value, list | tuple):
        values = [_checked(f"{name}[{i}]", int32, v) for i, v in enumerate(value)]
        getattr(msg, name).extend(values)
    else:
        setattr(msg, name, _checked(name, int32, value))


def make_request(
    text: str | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
    **fields: object,
) -> api_pb2.GenerateRequest:
    """A GenerateRequest from a text prompt or (role, content) messages; unset fields (None)
    keep the server's defaults. Fields of common.SamplingParams (temperature, seed, ...) go into
    `sampling`, the others (max_tokens, stop, ...) into the request itself. A seed may be
    negative, as in OpenAI's API (common.sampling.seed_value). Raises RequestError naming the
    field for a value that cannot be sent."""
    sampling_names = {f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields}
    req = api_pb2.GenerateRequest()
    req.sampling.SetInParent()
    for name, value in fields.items():
        if value is not None:
            _set(req.sampling if name in sampling_names else req, name, value)
    if messages is not None:
        req.chat.messages.extend(
            api_pb2.ChatMessage(
                role=_text(f"messages[{i}].role", role),
                content=_text(f"messages[{i}].content", content),
            )
            for i, (role, content) in enumerate(messages)
        )
    elif text is not None:
        req.text = _text("text", text)
    return req


class GatewayChannel:
    """A blocking channel to a gateway, and the metadata each call carries: key as a Bearer
    token, when the gateway requires one (--api-key, --api-keys; Admin's --admin-key)."""

    def __init__(self, address: str, key: str | None = None):
        self.address = with_default_port(address, DEFAULT_GATEWAY_PORT)  # "localhost": not 443
        self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.metadata = bearer_metadata(key)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()


class Client(GatewayChannel):
    """The Generation API of the gateway at address."""

    def __init__(self, address: str, api_key: str | None = None):
        super().__init__(address, api_key)
        self.stub = api_pb2_grpc.GenerationStub(self.channel)

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
