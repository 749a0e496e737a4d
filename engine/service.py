"""The engine's gRPC server: the Step stream and Describe, plus grpc.health.v1.

Steps run one at a time under a lock. A new Step stream resets the mirror and supersedes any older
stream (a reconnecting scheduler wins over its own dead connection)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.convert import info_to_proto, plan_from_proto, result_to_proto
from engine.mirror import MirrorMismatch, StepPlanData
from engine.runner import StepOutput
from llmserve.log import get_logger
from llmserve.net import SERVER_OPTIONS
from protos import engine_pb2, engine_pb2_grpc

log = get_logger("engine")


class StepExecutor(Protocol):
    """What the service needs of an engine (the real one, or engine.fake.FakeEngine)."""

    info: Any

    def reset(self) -> None: ...

    def step(self, plan: StepPlanData) -> StepOutput: ...


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(self, engine: StepExecutor):
        self.engine = engine
        self.lock = threading.Lock()
        self.active_stream = 0

    def Describe(self, request: engine_pb2.DescribeRequest, context: Any) -> Any:
        i = self.engine.info
        return info_to_proto(
            i.model,
            i.vocab_size,
            i.max_model_len,
            i.eos_token_ids,
            i.block_size,
            i.num_blocks,
            i.device,
            i.dtype,
        )

    def Step(self, request_iterator: Iterator[engine_pb2.StepPlan], context: Any) -> Any:
        with self.lock:
            self.active_stream += 1
            stream = self.active_stream
            self.engine.reset()
        log.info("step stream opened", stream=stream, peer=context.peer())
        for plan_msg in request_iterator:
            t0 = time.perf_counter()
            with self.lock:
                if stream != self.active_stream:
                    context.abort(grpc.StatusCode.ABORTED, "superseded by a newer Step stream")
                try:
                    output = self.engine.step(plan_from_proto(plan_msg))
                except MirrorMismatch as err:
                    log.error(
                        "plan disagrees with the mirror", step_id=plan_msg.step_id, error=str(err)
                    )
                    context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION, f"step {plan_msg.step_id}: {err}"
                    )
                except Exception as err:
                    log.exception("step failed", step_id=plan_msg.step_id)
                    context.abort(
                        grpc.StatusCode.INTERNAL,
                        f"step {plan_msg.step_id} failed: {type(err).__name__}: {err}",
                    )
            total_ms = (time.perf_counter() - t0) * 1e3
            yield result_to_proto(
                plan_msg.step_id,
                output.sampled_token_ids,
                output.logprobs,
                output.forward_ms,
                output.sample_ms,
                total_ms,
            )
        log.info("step stream closed", stream=stream)


def serve(engine: StepExecutor, host: str, port: int) -> None:
    """Serve until SIGTERM / SIGINT."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    engine_pb2_grpc.add_EngineServicer_to_server(EngineServicer(engine), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"engine: cannot listen on {host}:{port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("engine serving", address=f"{host}:{bound}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace=2).wait()
    log.info("engine stopped")
