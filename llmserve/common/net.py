"""gRPC plumbing shared by the three services and the client."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Plans with long prompts can be large; keepalive pings notice a peer that died without closing.
# A grpc.health.v1 service name that is SERVING for as long as the process answers at all (the
# scheduler and the gateway: their "" status also says whether they can serve now). A liveness
# probe asks for it, so a scheduler waiting for its engine is not restarted for it.
LIVENESS_SERVICE = "liveness"
# The gateway's gRPC port: its --port default, and the port a client dials when an address
# names none.
DEFAULT_GATEWAY_PORT = 50051

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 << 20),
    ("grpc.max_receive_message_length", 256 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer is found within 2 s of coming back, however long it was gone.
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
SERVER_OPTIONS = [
    *CHANNEL_OPTIONS,
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def with_default_port(address: str, port: int) -> str:
    """address with port added when it names none ("localhost" -> "localhost:50051"; gRPC
    would otherwise dial 443). Addresses with a scheme (dns:, unix:, ...) are left as they are;
    a bare IPv6 address gets brackets."""
    if address.startswith(_SCHEMES):
        return address
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{port}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{port}"
    return address if ":" in address else f"{address}:{port}"


def health_status(address: str, timeout: float = 2.0, service: str = "") -> tuple[str, str]:
    """(status, why) of the server at address: the health status name (SERVING, NOT_SERVING,
    ...) and "", or the gRPC code name (UNAVAILABLE, DEADLINE_EXCEEDED, ...) and the error's
    details (connection refused, timed out, ...) when the check failed."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name, err.details() or ""
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), ""


def check_health(address: str, timeout: float = 2.0, service: str = "") -> str:
    """The health status name of the server at address (SERVING, NOT_SERVING, ...), or
    UNAVAILABLE when it cannot be reached."""
    return health_status(address, timeout, service)[0]


def wait_until_serving(address: str, timeout: float, poll: float = 0.2) -> bool:
    """Poll the health service until SERVING or timeout; True when serving."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        timeout_now = min(2.0, max(0.1, deadline - time.monotonic()))
        if check_health(address, timeout=timeout_now) == "SERVING":
            return True
        time.sleep(poll)
    return False


# -- requests that do not parse ------------------------------------------------------------------

_DECODE_ERROR = re.compile(r"^Error parsing message with type '[\w.]+': ")


@dataclass(frozen=True, slots=True)
class _Malformed:
    """What a checked deserializer hands the handler for bytes that do not parse."""

    details: str


def _checked_deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(parse, "__self__", None)  # GenerateRequest.FromString: the class
    name = getattr(owner, "__name__", "message")

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as err:
            why = _DECODE_ERROR.sub("", str(err))
            return _Malformed(f"request is not a valid {name}: {why}")

    return deserialize


async def _passed_async(request: Any, context: Any) -> Any:
    """request, the call aborted with INVALID_ARGUMENT instead when it did not parse."""
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
    return request


def _passed(request: Any, context: Any) -> Any:
    """_passed_async for a sync server."""
    if isinstance(request, _Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details)
    return request


def _checked_behavior(behavior: Callable[..., Any], request_streaming: bool) -> Callable[..., Any]:
    """behavior(request or requests, context), aborting the call at a request that did not parse
    (handlers that read with context.read() are not covered); of the same kind (async
    generator, coroutine, plain function) as behavior, which gRPC looks at."""

    async def checked_async(arg: Any, context: Any) -> Any:
        if request_streaming:
            return (await _passed_async(request, context) async for request in arg)
        return await _passed_async(arg, context)

    if inspect.isasyncgenfunction(behavior):

        async def stream(arg: Any, context: Any) -> AsyncIterator[Any]:
            async for response in behavior(await checked_async(arg, context), context):
                yield response

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def unary(arg: Any, context: Any) -> Any:
            return await behavior(await checked_async(arg, context), context)

        return unary

    def plain(arg: Any, context: Any) -> Any:
        if request_streaming:
            return behavior((_passed(request, context) for request in arg), context)
        return behavior(_passed(arg, context), context)

    return plain


def behavior_field(handler: grpc.RpcMethodHandler) -> str:
    """The field of handler that holds its behavior: unary_unary, unary_stream, ..."""
    request = "stream" if handler.request_streaming else "unary"
    return request + ("_stream" if handler.response_streaming else "_unary")


def checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """handler, answering a request that does not parse (invalid UTF-8 in a string, a corrupt,
    truncated or too deeply nested wire format) with INVALID_ARGUMENT "request is not a valid
    <Message>: <why>" instead of gRPC's UNKNOWN or INTERNAL naming a Python class."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    kind = behavior_field(handler)
    behavior = _checked_behavior(getattr(handler, kind), handler.request_streaming)
    return handler._replace(request_deserializer=_checked_deserializer(parse), **{kind: behavior})


class _CheckedGenericHandler(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler):
        self.inner = inner
        self.handlers: dict[str, grpc.RpcMethodHandler | None] = {}

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = details.method
        if method not in self.handlers:
            handler = self.inner.service(details)
            self.handlers[method] = None if handler is None else checked_handler(handler)
        return self.handlers[method]


class _CheckedRegistration:
    """The server as a generated add_*Servicer_to_server sees it: what it registers is checked
    (checked_handler) on the way in."""

    def __init__(self, server: grpc.Server | grpc.aio.Server):
        self.server = server

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self.server.add_generic_rpc_handlers(tuple(_CheckedGenericHandler(h) for h in handlers))

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        checked = {method: checked_handler(h) for method, h in handlers.items()}
        self.server.add_registered_method_handlers(service, checked)


def add_servicer(
    add: Callable[[Any, Any], None], servicer: Any, server: grpc.Server | grpc.aio.Server
) -> None:
    """add(servicer, server), `add` being a generated add_*Servicer_to_server, with every
    method's requests checked (checked_handler): a client sending bytes that are not the
    request message gets INVALID_ARGUMENT saying so. Sync and asyncio servers alike:

        add_servicer(api_pb2_grpc.add_GenerationServicer_to_server, GatewayService(core), server)
    """
    add(servicer, _CheckedRegistration(server))


def listen(
    server: grpc.Server | grpc.aio.Server,
    name: str,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
) -> int:
    """Bind server to host:port, over TLS with credentials; the port bound (port 0: a free one).
    Raises RuntimeError naming the service when the address cannot be bound."""
    address = f"{host}:{port}"
    if credentials is None:
        bound = server.add_insecure_port(address)
    else:
        bound = server.add_secure_port(address, credentials)
    if bound == 0:
        raise RuntimeError(f"{name}: cannot listen on {address}")
    return bound


async def serve_aio(
    server: grpc.aio.Server,
    name: str,
    host: str,
    port: int,
    start: Callable[[], Coroutine[Any, Any, None]],
    stop: Callable[[], Awaitable[None]],
    credentials: grpc.ServerCredentials | None = None,
) -> None:
    """Bind, start, run `start()` in the background and serve until SIGTERM / SIGINT; then run
    `stop()` and shut the server down with a short grace period. credentials: TLS (else
    plaintext). If `start()` failed, its exception is raised once the server has stopped."""
    import asyncio
    import signal

    from llmserve.common.log import get_logger

    log = get_logger(name)
    bound = listen(server, name, host, port, credentials)
    await server.start()
    log.info(f"{name} listening", address=f"{host}:{bound}")
    task = asyncio.create_task(start())
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    done = asyncio.create_task(stopping.wait())
    await asyncio.wait([task, done], return_when=asyncio.FIRST_COMPLETED)
    failure = task.exception() if task.done() and not task.cancelled() else None
    if failure is not None:
        log.error(f"{name} background task failed", error=repr(failure))
    log.info(f"{name} stopping")
    await stop()
    await server.stop(grace=2)
    task.cancel()
    done.cancel()
    await asyncio.gather(task, done, return_exceptions=True)
    log.info(f"{name} stopped")
    if failure is not None:
        raise failure
