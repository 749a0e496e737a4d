"""The OpenAI Responses API's routes:

    POST   /v1/responses        a response, streamed (typed events) or not, over the chat path
    GET    /v1/responses/{id}   a stored response as it was sent
    DELETE /v1/responses/{id}   forget it

Neighbours: gateway/http.py (the shared request path, mounts these), gateway/responses_*.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from llmserve.gateway.choices import Choice
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.http_errors import ERRORS, ApiError, as_api_errors
from llmserve.gateway.http_generate import Endpoint, generate_response
from llmserve.gateway.openai_protocol import ChatCompletionRequest, ChatMessageParam
from llmserve.gateway.openai_responses import ResponseFormat
from llmserve.gateway.responses_format import ResponsesFormat
from llmserve.gateway.responses_request import (
    RENAMES,
    ResponsesRequest,
    chat_body,
    input_messages,
)
from llmserve.gateway.responses_store import ResponseStore, StoredResponse


def _not_found(response_id: str, param: str | None = None, status: int = 404) -> ApiError:
    return ApiError(
        status,
        f"no response with id {response_id[:100]!r} is stored here (responses live in one "
        "gateway's memory, bounded by --responses-store-size; store: false keeps none)",
        param=param,
        code="previous_response_not_found" if param else "not_found",
    )


def add_responses_routes(app: FastAPI, core: GatewayCore) -> None:
    store = ResponseStore(core.config.responses_store_size)

    def history(body: ResponsesRequest) -> list[ChatMessageParam]:
        if body.previous_response_id is None:
            return []
        stored = store.get(body.previous_response_id)
        if stored is None:  # 400, not 404: the request is wrong, the route is there
            raise _not_found(body.previous_response_id, "previous_response_id", 400)
        return stored.conversation

    def endpoint(body: ResponsesRequest, conversation: list[ChatMessageParam]) -> Endpoint:
        def on_finish(response_id: str, stored: StoredResponse) -> None:
            if body.store:
                store.put(response_id, stored)

        def make_format(
            core: GatewayCore, choices: list[Choice], response_id: str, chat: Any
        ) -> ResponseFormat:
            return ResponsesFormat(core, choices, response_id, chat, body, conversation, on_finish)

        return Endpoint("resp", "input", "chat", make_format, RENAMES, separator="_")

    @app.post("/v1/responses", responses=ERRORS)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        earlier = history(body)
        with as_api_errors("input", RENAMES):
            chat: ChatCompletionRequest = chat_body(body, earlier)
            conversation = earlier + input_messages(body.input)
        return await generate_response(core, request, chat, endpoint(body, conversation))

    @app.get("/v1/responses/{response_id}", responses=ERRORS)
    async def get_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return Response(stored.body, media_type="application/json")

    @app.delete("/v1/responses/{response_id}", responses=ERRORS)
    async def delete_response(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}
