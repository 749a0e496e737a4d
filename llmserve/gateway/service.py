"""The gateway process: the gRPC Generation service and the OpenAI-compatible HTTP API
(gateway/http.py), both over one request path (gateway/core.py) and one scheduler connection, on
one asyncio loop, and beside them the operator's Admin service (gateway/admin.py) on the gRPC port.
A client's cancellation cancels the handler, and with it the request upstream (gateway/core.py).

Who may call what (GatewayAuthInterceptor): the health service is open; Admin needs the admin
key; everything else needs a client key when any is configured (--api-key, --api-keys).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.common.auth import (
    OPEN_PREFIX,
    UNAUTHENTICATED_MESSAGE,
    authorization_of,
    denied,
    is_authorized,
)
from llmserve.common.log import bind
from llmserve.common.model_config import generation_defaults, resolve_model_path
from llmserve.common.net import LIVENESS_SERVICE, SERVER_OPTIONS, add_servicer, serve_aio
from llmserve.gateway.admin import AdminService
from llmserve.gateway.config import GatewayConfig
from llmserve.gateway.core import GatewayCore, new_request_id
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.quotas import Admission
from llmserve.gateway.tenants import ApiKey, TenantTable, display_name
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.protos import admin_pb2_grpc, api_pb2, api_pb2_grpc

ADMIN_PREFIX = "/llmserve.admin.v1.Admin/"
# The launcher asks this with the internal token (it may hold no client key: --api-keys with
# only SHA-256 digests) to tell the gateway it started from another server on the port.
MODEL_INFO_METHOD = "/llmserve.api.v1.Generation/GetModelInfo"
ADMIN_OFF_MESSAGE = "the Admin service is off: start the gateway with --admin-key"
ADMIN_UNAUTHENTICATED = "missing or wrong admin key: send 'Authorization: Bearer <admin key>'"
# The client key GatewayAuthInterceptor found for the call (None: none, or no keys configured).
# grpc.aio runs a call's interceptors and then its handler in the one task it makes for the
# call, so the handler reads what the interceptor set, and no other call sees it.
presented_key: ContextVar[ApiKey | None] = ContextVar("presented_key", default=None)


class GatewayAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admin calls need the admin key (PERMISSION_DENIED when none is set: the service is off;
    UNAUTHENTICATED without it, a client key included); the health service is open; every other
    call needs one of the client keys when any is configured (UNAUTHENTICATED); GetModelInfo
    also takes the internal token."""

    def __init__(
        self, tenants: TenantTable, admin_key: str | None, internal_token: str | None = None
    ):
        self.tenants = tenants
        self.admin_key = admin_key
        self.internal_token = internal_token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIX):
            return handler
        authorization = authorization_of(details)
        if details.method.startswith(ADMIN_PREFIX):
            if self.admin_key is None:
                return denied(handler, grpc.StatusCode.PERMISSION_DENIED, ADMIN_OFF_MESSAGE)
            if not is_authorized(authorization, self.admin_key):
                return denied(handler, grpc.StatusCode.UNAUTHENTICATED, ADMIN_UNAUTHENTICATED)
            return handler
        if not self.tenants.requires_key:
            return handler
        key = self.tenants.find_key(authorization)
        if key is not None:
            presented_key.set(key)
            return handler
        token = self.internal_token
        if details.method == MODEL_INFO_METHOD and token and is_authorized(authorization, token):
            return handler
        return denied(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


async def abort_with(context: grpc.aio.ServicerContext, err: GatewayError) -> None:
    """Fail the call with err's code and message; a quota's retry hint goes in the trailing
    metadata as `retry-after` (whole seconds), as HTTP's Retry-After header."""
    trailing = (("retry-after", str(err.retry_after_s)),) if err.retry_after_s else ()
    await context.abort(err.code, err.message, trailing_metadata=trailing)


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
            await abort_with(context, err)
            raise  # not reached: abort raises

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        request_id = request.request_id or new_request_id()
        trace = self.core.telemetry.start(context.invocation_metadata(), request_id, "grpc")
        admission: Admission | None = None
        try:
            # On a worker thread: a long prompt or chat takes a while to render and tokenize.
            valid = await asyncio.to_thread(self.core.validate, request)
            trace.validated(valid, request)
            caller = self.core.caller(presented_key.get(), request.user)
            bind(tenant=display_name(caller.tenant), key=caller.key_name)
            admission = self.core.admit(caller, [valid])
            async for msg in self.core.generate(valid, request_id, trace, admission):
                yield msg
        except GatewayError as err:
            trace.finish(code=err.code.name, message=err.message)  # no-op when generate ended it
            await abort_with(context, err)
        finally:
            if admission is not None:
                admission.release()


def make_server(core: GatewayCore) -> grpc.aio.Server:
    """The gateway's gRPC server, not yet bound: Generation, Admin and health, behind
    GatewayAuthInterceptor."""
    config = core.config
    auth = GatewayAuthInterceptor(core.tenants, config.admin_secret(), config.token())
    interceptors = [auth]
    # A request larger than max_request_bytes is refused (RESOURCE_EXHAUSTED) before parsing.
    limit = "grpc.max_receive_message_length"
    options = [o for o in SERVER_OPTIONS if o[0] != limit] + [(limit, config.max_request_bytes)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    add_servicer(api_pb2_grpc.add_GenerationServicer_to_server, GatewayService(core), server)
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, core.replicas.health, server)
    add_servicer(admin_pb2_grpc.add_AdminServicer_to_server, AdminService(core), server)
    return server


async def set_initial_health(core: GatewayCore) -> None:
    """Alive, not ready: readiness waits for a replica (gateway/replicas.py)."""
    await core.replicas.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await core.replicas.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)


async def serve(config: GatewayConfig, tenants: TenantTable | None = None) -> None:
    """Serve until stopped; tenants: the table of config's tenant file when its caller has
    read it already (else it is read here)."""
    path = resolve_model_path(config.model)
    tokenizer = Tokenizer.from_model_path(path)
    core = GatewayCore(config, tokenizer, tenants, generation_defaults(path))
    server = make_server(core)
    await set_initial_health(core)
    http = None
    if config.http_port:
        from llmserve.gateway.http import HttpServer, create_app  # FastAPI takes a second to import

        http = HttpServer(create_app(core), config.host, config.http_port)

    async def start() -> None:
        await asyncio.gather(core.replicas.watch_scheduler(), *([http.serve()] if http else []))

    async def stop() -> None:
        await core.replicas.health.enter_graceful_shutdown()
        if http is not None:
            await http.shutdown()

    await serve_aio(server, "gateway", config.host, config.port, start, stop)
    await core.replicas.close()
