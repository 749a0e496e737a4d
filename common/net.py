"""gRPC plumbing shared by the three services and the client."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# Plans with long prompts can be large; keepalive pings notice a peer that died without closing.
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


def check_health(address: str, timeout: float = 2.0, service: str = "") -> str:
    """The health status name of the server at address (SERVING, NOT_SERVING, ...), or
    UNAVAILABLE when it cannot be reached."""
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_until_serving(address: str, timeout: float, poll: float = 0.2) -> bool:
    """Poll the health service until SERVING or timeout; True when serving."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check_health(address, timeout=min(2.0, max(0.1, deadline - time.monotonic()))) == (
            "SERVING"
        ):
            return True
        time.sleep(poll)
    return False


async def serve_aio(
    server: grpc.aio.Server,
    name: str,
    host: str,
    port: int,
    start: Callable[[], Coroutine[Any, Any, None]],
    stop: Callable[[], Awaitable[None]],
) -> None:
    """Bind, start, run `start()` in the background and serve until SIGTERM / SIGINT; then run
    `stop()` and shut the server down with a short grace period. If `start()` failed, its
    exception is raised once the server has stopped."""
    import asyncio
    import signal

    from common.log import get_logger

    log = get_logger(name)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"{name}: cannot listen on {host}:{port}")
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
