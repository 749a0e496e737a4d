"""The optional API key, the same for both APIs: `Authorization: Bearer <key>` (an HTTP header, or
gRPC metadata `authorization`), compared in constant time. Health checks stay open, so load
balancers and `llmserve health` need no key."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

UNAUTHENTICATED_MESSAGE = "missing or wrong API key: send 'Authorization: Bearer <key>'"
_OPEN_GRPC_PREFIX = "/grpc.health.v1.Health/"


def is_authorized(authorization: str | None, api_key: str) -> bool:
    """Whether an Authorization value carries api_key as its Bearer token."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    # compare_digest's time depends only on the length of the key, never on where they differ.
    same = hmac.compare_digest(token.strip().encode(), api_key.encode())
    return scheme.lower() == "bearer" and same


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as handler that fails the call with UNAUTHENTICATED."""

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        deny,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every gRPC call but the health service's without the key (UNAUTHENTICATED)."""

    def __init__(self, api_key: str):
        self.api_key = api_key

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_OPEN_GRPC_PREFIX):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((v for k, v in metadata if k == "authorization"), None)
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        if is_authorized(authorization, self.api_key):
            return handler
        return _refusal(handler)
