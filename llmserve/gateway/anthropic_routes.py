"""Anthropic's Messages API routes (what Claude-style clients and coding agents speak):

    POST /v1/messages                a message, streamed (Anthropic's events) or not
    POST /v1/messages/count_tokens   {"input_tokens": N} of the same request, without running it

Errors under these paths take Anthropic's shape (gateway/http_errors.py); `x-api-key` is read
as the API key where `Authorization` is absent (gateway/http.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import Response

from llmserve.gateway.anthropic_format import AnthropicFormat
from llmserve.gateway.anthropic_request import RENAMES, MessagesRequest, chat_body
from llmserve.gateway.choices import Choice
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.http_errors import as_api_errors
from llmserve.gateway.http_generate import Endpoint, generate_response
from llmserve.gateway.openai_protocol import chat_request
from llmserve.gateway.openai_responses import ResponseFormat
from llmserve.gateway.validation import prompt_token_ids


def add_anthropic_routes(app: FastAPI, core: GatewayCore) -> None:
    def endpoint(body: MessagesRequest) -> Endpoint:
        def make_format(
            core: GatewayCore, choices: list[Choice], response_id: str, chat: Any
        ) -> ResponseFormat:
            return AnthropicFormat(core, choices, response_id, chat, body.model)

        return Endpoint("msg", "messages", "chat", make_format, RENAMES, separator="_")

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        with as_api_errors("messages", RENAMES):
            chat = chat_body(body)
        return await generate_response(core, request, chat, endpoint(body))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesRequest) -> dict[str, int]:
        with as_api_errors("messages", RENAMES):
            if core.replicas.limits is None:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
            req = chat_request(chat_body(body, need_max_tokens=False), core.tokenizer.tool_format)
            ids = await asyncio.to_thread(
                prompt_token_ids, req, core.tokenizer, core.replicas.limits
            )
        return {"input_tokens": len(ids)}
