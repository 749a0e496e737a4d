"""The gateway process: the gRPC Generation service and the OpenAI-compatible HTTP API
(gateway/http.py), both over one request path (gateway/core.py) and one scheduler connection, on
one asyncio loop. A client's cancellation cancels the handler, and with it the request upstream
(gateway/core.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.auth import BearerInterceptor
from common.model_config import resolve_model_path
from common.net import LIVENESS_SERVICE, SERVER_OPTIONS, add_servicer, serve_aio
from gateway.config import GatewayConfig
from gateway.core import GatewayCore, GatewayError, new_request_id
from gateway.tokenizer import Tokenizer
from protos import api_pb2, api_pb2_grpc


class GatewayService(api_pb2_grpc.GenerationServicer):
    """The gRPC API: GatewayCore's results as protobuf streams, its errors as status codes."""

    def __init__(self, core: GatewayCore):
        self.core = core

    async def GetModelInfo(
        self, request: api_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ModelInfo:
        try:
            return self.core.model_info()
        except GatewayError as err:
            await context.abort(err.code, err.message)
            raise  # not reached: abort raises

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        request_id = request.request_id or new_request_id()
        trace = self.core.telemetry.start(context.invocation_metadata(), request_id, "grpc")
        try:
            # On a worker thread: a long prompt or chat takes a while to render and tokenize.
            valid = await asyncio.to_thread(self.core.validate, request)
            trace.validated(valid, request)
            async for msg in self.core.generate(valid, request_id, trace):
                yield msg
        except GatewayError as err:
            trace.finish(code=err.code.name, message=err.message)  # no-op when generate ended it
            await context.abort(err.code, err.message)


async def serve(config: GatewayConfig) -> None:
    tokenizer = Tokenizer.from_model_path(resolve_model_path(config.model))
    core = GatewayCore(config, tokenizer)
    interceptors = [BearerInterceptor(config.api_key)] if config.api_key else []
    # A request larger than max_request_bytes is refused (RESOURCE_EXHAUSTED) before parsing.
    limit = "grpc.max_receive_message_length"
    options = [o for o in SERVER_OPTIONS if o[0] != limit] + [(limit, config.max_request_bytes)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add_servicer(api_pb2_grpc.add_GenerationServicer_to_server, GatewayService(core), server)
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, core.health, server)
    await core.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await core.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    http = None
    if config.http_port:
        from gateway.http import HttpServer, create_app  # FastAPI takes a second to import

        http = HttpServer(create_app(core), config.host, config.http_port)

    async def start() -> None:
        await asyncio.gather(core.watch_scheduler(), *([http.serve()] if http else []))

    async def stop() -> None:
        await core.health.enter_graceful_shutdown()
        if http is not None:
            await http.shutdown()

    await serve_aio(server, "gateway", config.host, config.port, start, stop)
    await core.close()
