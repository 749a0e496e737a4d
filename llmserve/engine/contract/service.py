"""The engine's gRPC server: the Step stream and Describe, plus grpc.health.v1.

Steps run in plan order under a lock, one Step stream at a time (a second is ALREADY_EXISTS
while the first lasts); with an internal token set, only callers carrying it get in
(common/auth.py). A stream is a small pipeline (a reader thread, the stream loop that launches
each plan as it arrives, a waiter thread), so step N+1 is launched while step N's result is
still being copied back and sent: docs/architecture.md#overlap-scheduling.

Every engine call (reset, launch, finish) runs on the thread that built the engine, the process's
main thread (`OwnerThread`), not on a gRPC worker: torch's OpenMP team belongs to the thread that
first ran parallel work, and a forward from another thread starts a second team that fights the
first for the cores (measured on 2 cores: a batch-1 decode step 95 ms there against 47 ms here).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.common.auth import peer_interceptors
from llmserve.common.log import get_logger
from llmserve.common.net import SERVER_OPTIONS, add_servicer, listen
from llmserve.common.step_plan import StepOutput, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.contract import EngineInfo
from llmserve.engine.contract.convert import info_to_proto, plan_from_proto, result_to_proto
from llmserve.engine.contract.mirror import MirrorMismatch
from llmserve.engine.contract.telemetry import EngineTelemetry, now_ns
from llmserve.protos import engine_pb2, engine_pb2_grpc

if TYPE_CHECKING:  # this module stays torch-free (the echo engine serves through it)
    from llmserve.engine.parallel.groups import Parallel

log = get_logger("engine")


class LaunchedStepLike(Protocol):
    @property
    def is_ready(self) -> bool: ...

    def wait(self) -> None: ...


class StepExecutor(Protocol):
    """What the service needs of an engine (the real one, or engine.fake.EchoEngine): `launch`
    enqueues a plan's step (in plan order) and `finish` waits for its output."""

    info: EngineInfo

    def reset(self) -> None: ...

    def launch(self, plan: StepPlanData) -> Any: ...

    def finish(self, step: Any) -> StepOutput: ...


# Inbox items besides plans: the stream ended; a launched step may be ready.
_END = object()
_WAKE = object()


@dataclass
class _InFlight:
    plan_msg: engine_pb2.StepPlan
    step: LaunchedStepLike
    t0: float
    start_ns: int


def _read_plans(
    plans: Iterator[engine_pb2.StepPlan],
    inbox: queue.SimpleQueue[Any],
    group: Parallel | None = None,
) -> None:
    """Put each plan in the inbox as it arrives; with an engine group, hand it to the other
    ranks first (at once, so an earlier pipeline stage starts it while the driver's stage still
    runs the step before)."""
    try:
        for plan_msg in plans:
            if group is not None:
                _to_ranks(group, "plan", plan_msg.SerializeToString())
            inbox.put(plan_msg)
    except Exception:  # the RPC ended under us (cancelled, connection lost)
        pass
    finally:
        inbox.put(_END)


def _to_ranks(group: Parallel, kind: str, payload: bytes = b"") -> None:
    """Send a control message to the group's other ranks; when that fails (a rank is gone),
    end this process so the group restarts as one (engine/parallel/ranks.py)."""
    try:
        group.send_control(kind, payload)
    except Exception:
        log.exception("an engine rank is unreachable; ending the group")
        os._exit(1)


class _Waiter:
    """A thread waiting for launched steps in launch order, waking the stream loop as each one's
    results reach the host (waiting releases the GIL: the loop keeps launching meanwhile)."""

    def __init__(self, inbox: queue.SimpleQueue[Any]):
        self.inbox = inbox
        self.steps: queue.SimpleQueue[LaunchedStepLike | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="step-waiter", daemon=True).start()

    def watch(self, step: LaunchedStepLike) -> None:
        self.steps.put(step)

    def close(self) -> None:
        self.steps.put(None)

    def _run(self) -> None:
        while (step := self.steps.get()) is not None:
            with contextlib.suppress(Exception):  # finish() raises it again, in the stream loop
                step.wait()
            self.inbox.put(_WAKE)


class OwnerThread:
    """Runs calls on the thread that calls `run_until` (the one that built the engine) and hands
    each caller its result or exception."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[tuple[futures.Future[Any], Callable[..., Any], tuple]] = (
            queue.SimpleQueue()
        )

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        future: futures.Future[Any] = futures.Future()
        self.calls.put((future, fn, args))
        return future.result()

    def run_until(self, stop: threading.Event, poll_s: float = 0.1) -> None:
        while not stop.is_set():
            try:
                future, fn, args = self.calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as err:  # the caller re-raises it
                future.set_exception(err)


def _direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    def __init__(
        self,
        engine: StepExecutor,
        run_on: Callable[..., Any] = _direct,
        group: Parallel | None = None,
    ):
        """run_on(fn, *args): where engine calls run (serve: OwnerThread.call). group: the
        engine group this driver leads (engine/parallel/groups.py): plans and resets go to every
        rank, and a step that fails part-way ends the group (its ranks are out of step)."""
        self.engine = engine
        self.run_on = run_on
        self.group = group
        self.lock = threading.Lock()
        self.active_stream = 0  # the live Step stream's number; 0 when none
        self.num_streams = 0
        self.telemetry = EngineTelemetry(
            lambda: getattr(getattr(engine, "model", None), "weight_path", None)
        )

    def Describe(self, request: engine_pb2.DescribeRequest, context: Any) -> Any:
        return info_to_proto(self.engine.info)

    def AddLora(self, request: engine_pb2.AddLoraRequest, context: Any) -> Any:
        """Check an adapter into the engine's host cache (engine/features/adapters.py):
        INVALID_ARGUMENT
        naming it and the reason when it cannot be served."""
        add = getattr(self.engine, "add_lora", None)
        if add is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this engine serves no adapters")
        with self.lock:
            try:
                adapter = self.run_on(add, request.lora_name, request.path)
            except ValueError as err:  # engine.lora_files.LoraError
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        log.info("lora added", lora_name=adapter.name, rank=adapter.rank, path=adapter.path)
        return engine_pb2.AddLoraResponse(
            rank=adapter.rank, target_modules=list(adapter.target_modules)
        )

    def RemoveLora(self, request: engine_pb2.RemoveLoraRequest, context: Any) -> Any:
        remove = getattr(self.engine, "remove_lora", None)
        if remove is not None:
            with self.lock:
                self.run_on(remove, request.lora_name)
        return engine_pb2.RemoveLoraResponse()

    def Step(self, request_iterator: Iterator[engine_pb2.StepPlan], context: Any) -> Any:
        with self.lock:
            if self.active_stream:
                log.warning("second step stream refused", peer=context.peer())
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    "a scheduler already holds this engine's Step stream (one at a time)",
                )
            self.num_streams += 1
            stream = self.active_stream = self.num_streams
            self.run_on(self.engine.reset)
            if self.group is not None:
                _to_ranks(self.group, "reset")
        log.info("step stream opened", stream=stream, peer=context.peer())
        inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        threading.Thread(
            target=_read_plans,
            args=(request_iterator, inbox, self.group),
            name="plan-reader",
            daemon=True,
        ).start()
        waiter = _Waiter(inbox)
        try:
            yield from self._run_stream(inbox, waiter, context)
        finally:
            waiter.close()
            with self.lock:
                self.active_stream = 0
        log.info("step stream closed", stream=stream)

    def _run_stream(
        self, inbox: queue.SimpleQueue[Any], waiter: _Waiter, context: Any
    ) -> Iterator[engine_pb2.StepResult]:
        """Launch plans as they come; yield results in order as soon as they are ready."""
        in_flight: deque[_InFlight] = deque()
        while True:
            while in_flight and in_flight[0].step.is_ready:
                yield self._finish(in_flight.popleft(), context)
            item = inbox.get()
            if item is _END:
                return
            if item is _WAKE:
                continue
            launched = self._launch(item, context)
            in_flight.append(launched)
            if not launched.step.is_ready:
                waiter.watch(launched.step)

    def _launch(self, plan_msg: engine_pb2.StepPlan, context: Any) -> _InFlight:
        t0 = time.perf_counter()
        start_ns = now_ns()
        with self.lock:
            try:
                step = self.run_on(self.engine.launch, plan_from_proto(plan_msg))
            except MirrorMismatch as err:
                log.error(
                    "plan disagrees with the mirror", step_id=plan_msg.step_id, error=str(err)
                )
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, f"step {plan_msg.step_id}: {err}"
                )
            except Exception as err:
                self._fail(plan_msg, err, context)
        return _InFlight(plan_msg, step, t0, start_ns)

    def _finish(self, launched: _InFlight, context: Any) -> engine_pb2.StepResult:
        plan_msg = launched.plan_msg
        with self.lock:
            try:
                output = self.run_on(self.engine.finish, launched.step)
            except Exception as err:
                self._fail(plan_msg, err, context)
        total_ms = (time.perf_counter() - launched.t0) * 1e3
        self.telemetry.on_step(
            plan_msg, launched.start_ns, output.forward_ms, output.sample_ms, total_ms
        )
        return result_to_proto(plan_msg.step_id, output, total_ms)

    def _fail(self, plan_msg: engine_pb2.StepPlan, err: Exception, context: Any) -> None:
        log.exception("step failed", step_id=plan_msg.step_id)
        if self.group is not None:
            log.error("the engine group's ranks are out of step; ending the group")
            os._exit(1)
        context.abort(
            grpc.StatusCode.INTERNAL,
            f"step {plan_msg.step_id} failed: {type(err).__name__}: {err}",
        )


def serve(engine: StepExecutor, config: EngineConfig, group: Parallel | None = None) -> None:
    """Serve until SIGTERM / SIGINT: only to peers with the internal token (when there is one),
    over TLS when config has a certificate. group: the engine group this process drives."""
    host, port = config.host, config.port
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        options=SERVER_OPTIONS,
        interceptors=peer_interceptors(config, aio=False),
    )
    owner = OwnerThread()
    servicer = EngineServicer(engine, owner.call, group)
    add_servicer(engine_pb2_grpc.add_EngineServicer_to_server, servicer, server)
    health_servicer = health.HealthServicer()
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, health_servicer, server)
    bound = listen(server, "engine", host, port, config.server_credentials())
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("engine serving", address=f"{host}:{bound}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    owner.run_until(stop)
    health_servicer.enter_graceful_shutdown()
    owner.run_until(server.stop(grace=2))  # a stream may still be in an engine call
    if group is not None:  # other nodes' ranks end cleanly (this node's end with this process)
        stopper = threading.Thread(target=group.send_control, args=("stop",), daemon=True)
        stopper.start()
        stopper.join(timeout=5)
    log.info("engine stopped")
