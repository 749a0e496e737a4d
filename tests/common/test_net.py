"""common.net.add_servicer: any generated servicer, on a sync or an asyncio gRPC server, answers a
request that does not parse with INVALID_ARGUMENT naming the message type and why, for unary and
streamed requests alike, and keeps serving."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.common.net import add_servicer
from llmserve.protos import engine_pb2, engine_pb2_grpc
from llmserve.topology import free_port

BAD_UTF8_SERVICE = b"\x0a\x02\xc3\x28"  # HealthCheckRequest.service = b"\xc3(": not UTF-8
TRUNCATED_PLAN = b"\x08"  # StepPlan.step_id, its varint missing


class EchoSteps(engine_pb2_grpc.EngineServicer):
    def Step(self, plans: Iterator[engine_pb2.StepPlan], context: Any) -> Any:
        for plan in plans:
            yield engine_pb2.StepResult(step_id=plan.step_id)


class AsyncEchoSteps(engine_pb2_grpc.EngineServicer):
    async def Step(self, plans: AsyncIterator[engine_pb2.StepPlan], context: Any) -> Any:
        async for plan in plans:
            yield engine_pb2.StepResult(step_id=plan.step_id)


def check(address: str) -> None:
    """What every server below must do, asked by a plain sync client."""
    with grpc.insecure_channel(address) as channel:
        check_raw = channel.unary_unary("/grpc.health.v1.Health/Check")
        with pytest.raises(grpc.RpcError) as err:
            check_raw(BAD_UTF8_SERVICE, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == (
            "request is not a valid HealthCheckRequest: String field had bad UTF-8"
        )
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1  # SERVING

        step = channel.stream_stream("/llmserve.engine.v1.Engine/Step")
        good = engine_pb2.StepPlan(step_id=7).SerializeToString()
        replies = step(iter([good, TRUNCATED_PLAN]), timeout=5)
        assert engine_pb2.StepResult.FromString(next(replies)).step_id == 7
        with pytest.raises(grpc.RpcError) as err:
            next(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("request is not a valid StepPlan: Wire format was corrupt")


def test_sync_server() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_servicer = health.HealthServicer()
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server)
    add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, EchoSteps(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        check(f"127.0.0.1:{port}")
    finally:
        server.stop(grace=None)


def test_asyncio_server() -> None:
    started = threading.Event()
    address: list[str] = []
    stop: list[Callable[[], None]] = []

    async def serve() -> None:
        server = grpc.aio.server()
        health_servicer = health.aio.HealthServicer()
        add_servicer(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server)
        add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, AsyncEchoSteps(), server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        address.append(f"127.0.0.1:{port}")
        done = asyncio.Event()
        loop = asyncio.get_running_loop()
        stop.append(lambda: loop.call_soon_threadsafe(done.set))
        started.set()
        await done.wait()
        await server.stop(grace=None)

    thread = threading.Thread(target=asyncio.run, args=(serve(),))
    thread.start()
    try:
        assert started.wait(10)
        check(address[0])
    finally:
        if stop:
            stop[0]()
        thread.join(10)
