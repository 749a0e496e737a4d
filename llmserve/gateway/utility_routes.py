"""The HTTP routes beside the OpenAI API that tools expect of an OpenAI-compatible server:

    POST /tokenize     vLLM's shape: {"prompt"} or {"messages"} -> {"count", "max_model_len",
                       "tokens", "token_strs"}; the same tokenizing and limits as a request
    POST /detokenize   {"tokens"} -> {"prompt"}
    GET  /metrics      the gateway's Prometheus metrics, as --metrics-port serves them (aiperf
                       and others look for them on the API's port)

Neighbours: gateway/http.py mounts these; gateway/validation.py tokenizes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from llmserve.gateway.core import GatewayCore
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.http_errors import ERRORS, as_api_errors
from llmserve.gateway.openai_protocol import ChatCompletionRequest, ChatMessageParam, chat_request
from llmserve.gateway.openai_structured import text_field
from llmserve.gateway.validation import ValidationError, prompt_token_ids
from llmserve.protos import api_pb2


class TokenizeRequest(BaseModel):
    """One of prompt (text) or messages (through the chat template), as vLLM takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _request(body: TokenizeRequest) -> api_pb2.GenerateRequest:
    """The GenerateRequest whose prompt is body's. Raises ValidationError."""
    if (body.prompt is None) == (body.messages is None):
        raise ValidationError("prompt (text) or messages: send exactly one")
    if body.prompt is not None:
        return api_pb2.GenerateRequest(text=text_field("prompt", body.prompt))
    chat = ChatCompletionRequest(
        messages=body.messages or [],
        tools=body.tools,
        chat_template_kwargs=body.chat_template_kwargs,
    )
    return chat_request(chat)


def add_utility_routes(app: FastAPI, core: GatewayCore) -> None:
    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        field = "messages" if body.messages is not None and body.prompt is None else "prompt"
        with as_api_errors(field):
            if core.replicas.limits is None or core.replicas.info is None:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
            req = _request(body)
            # a long prompt takes a while to tokenize: off the event loop
            ids = await asyncio.to_thread(
                prompt_token_ids, req, core.tokenizer, core.replicas.limits
            )
        return TokenizeResponse(
            count=len(ids), max_model_len=core.replicas.info.max_model_len, tokens=ids
        )

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        vocab = core.tokenizer.vocab_size
        for i, t in enumerate(body.tokens):
            if not 0 <= t < vocab:
                with as_api_errors("tokens"):
                    raise ValidationError(f"tokens[{i}]={t} is outside the vocabulary [0, {vocab})")
        return DetokenizeResponse(prompt=core.tokenizer.decode(body.tokens, False))

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
