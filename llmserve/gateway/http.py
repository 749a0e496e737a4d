"""The OpenAI-compatible HTTP API: FastAPI, served by uvicorn on the gateway's event loop beside
grpc.aio, over the same request path (gateway/core.py) and the same scheduler connection.

This module holds /v1/completions, /v1/chat/completions, /v1/models, /health and /ready; the
Responses API is gateway/responses_routes.py, Anthropic's Messages API
gateway/anthropic_routes.py, /tokenize, /detokenize and /metrics gateway/utility_routes.py,
error bodies gateway/http_errors.py. Each of a prompt's n choices is its own scheduler request;
a client that disconnects cancels them all. The endpoints and status codes:
docs/api.md#openai-compatible-http-api.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.common import __version__
from llmserve.common.auth import UNAUTHENTICATED_MESSAGE
from llmserve.common.log import get_logger
from llmserve.gateway.anthropic_routes import add_anthropic_routes
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.http_errors import ERRORS, ApiError, add_error_handlers, as_api_errors
from llmserve.gateway.http_generate import generate_response
from llmserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)
from llmserve.gateway.responses_routes import add_responses_routes
from llmserve.gateway.tenants import TenantTable
from llmserve.gateway.utility_routes import add_utility_routes

log = get_logger("gateway")


class ApiKeyMiddleware:
    """Refuses /v1/ requests without `Authorization: Bearer <key>`, key being one of the
    tenant table's (401), before anything else reads them; the key found is the request's
    `state.api_key` (presented_key). Plain ASGI, so streamed responses pass through untouched.
    """

    def __init__(self, app: ASGIApp, tenants: TenantTable):
        self.app = app
        self.tenants = tenants

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            if not authorization and b"x-api-key" in headers:  # Anthropic's clients' header
                authorization = "Bearer " + headers[b"x-api-key"].decode("latin-1")
            key = self.tenants.find_key(authorization)
            if key is None:
                error = ApiError(
                    401,
                    UNAUTHENTICATED_MESSAGE,
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response(scope["path"])(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuses a request body over max_bytes with 413 before anything parses it: at once when
    Content-Length says so (the body is never read), otherwise as soon as the bytes received
    pass the limit (a chunked upload). It reads the body itself and hands it on whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self, size: str, path: str) -> Response:
        message = f"the request body has {size} bytes; the limit is {self.max_bytes} "
        return ApiError(413, message + "(max_request_bytes)").response(path)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(str(int(length)), scope["path"])(scope, receive, send)
            return
        received = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away mid-upload
            received += message.get("body", b"")
            if len(received) > self.max_bytes:
                too_large = self._too_large(f"more than {self.max_bytes}", scope["path"])
                await too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body = [bytes(received)]

        async def replay() -> Message:
            if body:
                return {"type": "http.request", "body": body.pop(), "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, replay, send)


def create_app(core: GatewayCore) -> FastAPI:
    """The HTTP API's app: the routes over core, errors in OpenAI's shape, the body limit and
    (with keys configured) the key check."""
    app = FastAPI(
        title="llmserve",
        version=__version__,
        description="OpenAI-compatible completions and chat completions.",
    )
    add_error_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate_response(core, request, body)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate_response(core, request, body)

    add_responses_routes(app, core)
    add_anthropic_routes(app, core)
    _add_model_routes(app, core)
    add_utility_routes(app, core)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        if core.replicas.serving:
            return Response('{"status":"ready"}', media_type="application/json")
        error = GatewayError(
            grpc.StatusCode.UNAVAILABLE, "not ready: the scheduler is not serving yet"
        )
        return ApiError.from_gateway(error, "model").response()

    app.add_middleware(BodyLimitMiddleware, max_bytes=core.config.max_request_bytes)
    if core.tenants.requires_key:  # added last, so it runs first: no key, no body read
        app.add_middleware(ApiKeyMiddleware, tenants=core.tenants)
    return app


def _add_model_routes(app: FastAPI, core: GatewayCore) -> None:
    """/v1/models and /v1/models/{id}: the one model core serves."""
    started = int(time.time())

    def model_cards() -> list[ModelCard]:
        """The base model, its aliases (--served-model-name's other names), then each LoRA
        adapter served on it (its parent)."""
        with as_api_errors("model"):
            info = core.model_info()
        limit = info.max_model_len
        root = core.config.model or info.model  # no --model: the built-in model's id
        base = ModelCard(id=info.model, created=started, max_model_len=limit, root=root)
        aliases = [
            ModelCard(id=name, created=started, max_model_len=limit, root=root)
            for name in core.config.served_model_name[1:]
        ]
        adapters = [
            ModelCard(id=name, created=started, max_model_len=limit, root=name, parent=base.id)
            for name in info.lora_names
        ]
        return [base, *aliases, *adapters]

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models() -> ModelList:
        return ModelList(data=model_cards())

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
    async def model(model_id: str) -> ModelCard:
        cards = model_cards()
        for card in cards:
            if card.id == model_id:
                return card
        served = ", ".join(c.id for c in cards)
        raise ApiError(
            404,
            f"model {model_id!r} is not served here; models: {served}",
            param="model",
            code="model_not_found",
        )


# -- the server ------------------------------------------------------------------------------------


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handlers: the gateway's loop owns SIGTERM / SIGINT."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """The HTTP API on an already bound socket (so a taken port fails the gateway at start)."""

    def __init__(self, app: FastAPI, host: str, port: int):
        self.address = f"{host}:{port}"
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as err:
            self.socket.close()
            raise RuntimeError(f"gateway: cannot listen on {host}:{port} for HTTP ({err})") from err
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self.server = _EmbeddedServer(config)
        self.stopped = asyncio.Event()

    async def serve(self) -> None:
        log.info("gateway HTTP listening", address=self.address)
        try:
            await self.server.serve(sockets=[self.socket])
        finally:
            self.stopped.set()

    async def shutdown(self) -> None:
        """Stop accepting, let open responses finish (2 s at most), return when stopped."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self.stopped.wait(), timeout=5)
        except TimeoutError:
            log.warning("HTTP server did not stop in time")
