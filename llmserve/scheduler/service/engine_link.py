"""EngineLink: the scheduler's side of one engine: the connection, the engine's heartbeat, and the
step loop that drives the engine over one bidirectional Step stream with that engine's Scheduler.
The SchedulerService holds one link per engine (`service.links`) and hears from each through
LinkEvents (engine up, result applied, engine lost, health changed).

A broken stream preempts every running request (recomputed later) and reconnects; nothing sent
is resent. A heartbeat every HEARTBEAT_S on the same channel turns health NOT_SERVING after
MAX_MISSED_HEARTBEATS silent probes, without touching the stream. Steps in flight: two with
overlap scheduling, else one; with P pipeline stages at least P (kept disjoint by
scheduler/pipeline.py).
See docs/architecture.md#when-a-process-fails and #overlap-scheduling.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.common.log import get_logger
from llmserve.protos import engine_pb2, engine_pb2_grpc
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import StepOutcome, StepPlan
from llmserve.scheduler.request import RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import apply_result, plan_to_proto
from llmserve.scheduler.service.telemetry import SchedulerTelemetry

log = get_logger("scheduler")

HEARTBEAT_S = 1.0  # how often the engine is probed, and how long a probe may take
MAX_MISSED_HEARTBEATS = 3


class EngineLost(Exception):
    """The engine ended the Step stream without an error status."""


class EngineMismatch(Exception):
    """The engine's limits contradict this scheduler's settings: fatal, the service stops."""


@dataclass
class SentStep:
    """A plan sent to the engine whose result has not been read: perf_counter times of when
    planning started and ended."""

    plan: StepPlan
    t_plan: float
    t_planned: float


@dataclass
class StepTimes:
    """Sums over all steps, milliseconds. With overlap a step's round trip (plan sent -> result
    read) includes planning and sending the next step, which run while the engine computes."""

    schedule_ms: float = 0.0
    update_ms: float = 0.0
    step_rtt_ms: float = 0.0
    engine_total_ms: float = 0.0
    engine_forward_ms: float = 0.0
    engine_sample_ms: float = 0.0


class LinkEvents(Protocol):
    """What an EngineLink tells its owner (the SchedulerService), each between two awaits."""

    def scheduler_made(self, link: EngineLink, scheduler: Scheduler) -> None:
        """link made its Scheduler (its engine connected for the first time)."""

    def engine_up(self, link: EngineLink) -> None:
        """link's engine connected (again), its role checked."""

    def result_applied(self, link: EngineLink) -> None:
        """A step result of link's engine was applied to its Scheduler."""

    def engine_lost(self, link: EngineLink) -> None:
        """link's engine was lost; its Scheduler was reset (every request of it waits)."""

    def health_changed(self) -> None:
        """link's readiness or heartbeat changed."""


def deliver(streams: dict[int, asyncio.Queue[StepOutcome]], outcome: StepOutcome) -> None:
    """Hand outcome to its request's Submit stream, if it still has one."""
    queue = streams.get(outcome.request.seq_id)
    if queue is not None:
        queue.put_nowait(outcome)


class EngineLink:
    """One engine, its connection and its Scheduler (None until the engine first connects)."""

    def __init__(
        self,
        config: SchedulerConfig,
        role: str,
        address: str,
        streams: dict[int, asyncio.Queue[StepOutcome]],
        telemetry: SchedulerTelemetry,
        events: LinkEvents,
    ):
        """role: the engine's ("both", "prefill" or "decode"; checked when it connects).
        streams, telemetry: the service's, shared by every link (one stream per request,
        whichever engine runs it)."""
        self.config = config
        self.role = role
        self.address = address  # the engine's gRPC address
        self.streams = streams
        self.telemetry = telemetry
        self.events = events
        self.scheduler: Scheduler | None = None
        self.engine_info: engine_pb2.EngineInfo | None = None
        self.engine_stub: Any = None  # the connected engine's gRPC stub
        self.wakeup = asyncio.Event()
        self.ready = False  # the Step stream to the engine is open
        self.been_ready = False  # it has been open once
        self.engine_responding = True  # the engine's heartbeat (see HEARTBEAT_S)
        self.last_result_at = 0.0  # time.monotonic() of the last step result
        self.stopping = False
        self.times = StepTimes()
        self.num_engine_resets = 0

    @property
    def up(self) -> bool:
        """Whether the engine takes work now: connected, its Step stream open, answering."""
        return self.scheduler is not None and self.ready and self.engine_responding

    async def run(self) -> None:
        """Connect to the engine, run steps; on any stream failure reset and reconnect."""
        backoff = 0.2
        metadata = self.config.peer_metadata()
        async with (
            self.config.channel(self.address) as channel,
            self._heartbeat(channel, metadata),
        ):
            stub = engine_pb2_grpc.EngineStub(channel)
            while not self.stopping:
                try:
                    info = await stub.Describe(
                        engine_pb2.DescribeRequest(), timeout=5, metadata=metadata
                    )
                    self._on_engine_info(info)
                    self.engine_stub = stub
                    await self._add_configured_loras()
                    backoff = 0.2
                    await self._step_loop(stub, metadata)
                except EngineMismatch as err:
                    log.error("refusing the engine", error=str(err))
                    raise
                except grpc.aio.AioRpcError as err:
                    if self.ready:
                        log.warning(
                            "engine stream lost", code=err.code().name, details=err.details()
                        )
                except EngineLost as err:
                    log.warning("engine stream lost", details=str(err))
                except Exception:
                    log.exception("step loop failed; resetting the engine")
                was_ready = self.ready
                self._set_ready(False)
                if self.scheduler is not None:
                    # The engine's mirror and KV pool (prefix cache included) are gone either way,
                    # and so are the results of steps in flight.
                    self.telemetry.on_engine_reset(self.scheduler.reset_engine())
                    self.num_engine_resets += was_ready
                    self.events.engine_lost(self)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _on_engine_info(self, info: engine_pb2.EngineInfo) -> None:
        """Adopt the engine's limits (ours may be lower, never higher), pool geometry and
        pipeline stages (0, from an engine older than the field: 1). Called with nothing
        running: at start, or after reset_engine."""
        pipeline_parallel_size = info.pipeline_parallel_size or 1
        try:
            config = self.config.adopt(info.max_num_seqs, info.max_num_batched_tokens)
            max_len = min(info.max_model_len, config.max_model_len or info.max_model_len)
            if self.scheduler is None:
                self.scheduler = self._new_scheduler(config, info, max_len)
            else:
                self.scheduler.config = config
                self.scheduler.set_pipeline_parallel_size(pipeline_parallel_size)
                self.scheduler.set_num_speculative_tokens(info.num_speculative_tokens)
                self.scheduler.set_offload_tiers(
                    info.num_host_blocks, info.num_disk_blocks, info.kv_block_bytes
                )
                resized = self.scheduler.resize(
                    info.num_blocks, info.block_size, info.num_state_slots,
                    info.num_state_snapshot_slots,
                )  # fmt: skip
                for request in resized:
                    outcome = StepOutcome(request, None, None, RequestStatus.FINISHED_ABORTED)
                    deliver(self.streams, outcome)
            if self.scheduler.loras.max_loras != info.max_loras:
                self.scheduler.loras.resize(info.max_loras)
        except ValueError as err:  # a limit above the engine's, or a policy refusing its stages
            raise EngineMismatch(str(err)) from err
        self.scheduler.set_sliding_window(info.sliding_window or None)
        self._adopt_role(info)
        self.engine_info = info
        log.info(
            "engine connected",
            model=info.model,
            device=info.device,
            dtype=info.dtype,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_model_len=max_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            tensor_parallel_size=info.tensor_parallel_size or 1,
            pipeline_parallel_size=pipeline_parallel_size,
            speculative_method=info.speculative_method or "none",
            num_speculative_tokens=info.num_speculative_tokens,
            kv_offload_host_blocks=info.num_host_blocks,
            kv_offload_disk_blocks=info.num_disk_blocks,
            num_state_slots=info.num_state_slots,
            num_state_snapshot_slots=info.num_state_snapshot_slots,
            prefix_caching=self._prefix_caching(),
        )
        if config.preemption_mode == "swap" and not info.num_host_blocks:
            log.warning(
                "preemption_mode='swap' without a host tier: preempted requests recompute "
                "(start the engine with --kv-offload-gb)"
            )

    def _prefix_caching(self) -> str:
        """The start line's word on the prefix cache: on, off (the config's), or off with the
        reason (a model with state layers)."""
        assert self.scheduler is not None
        if self.scheduler.enable_prefix_caching:
            return "on"
        if self.config.enable_prefix_caching:
            return (
                "off: the model's linear-attention layers keep a recurrent state per request, "
                "which a cached block's KV does not restore; the engine's "
                "--state-snapshot-slots keeps states at block ends (docs/models.md)"
            )
        return "off"

    def _new_scheduler(
        self, config: SchedulerConfig, info: engine_pb2.EngineInfo, max_len: int
    ) -> Scheduler:
        """The Scheduler for the engine that connected first (info)."""
        scheduler = Scheduler(
            config,
            info.num_blocks,
            info.block_size,
            max_len,
            info.vocab_size,
            tuple(info.eos_token_ids),
            pipeline_parallel_size=info.pipeline_parallel_size or 1,
            num_speculative_tokens=info.num_speculative_tokens,
            num_host_blocks=info.num_host_blocks,
            num_disk_blocks=info.num_disk_blocks,
            kv_block_bytes=info.kv_block_bytes,
            num_state_slots=info.num_state_slots,
            num_state_snapshot_slots=info.num_state_snapshot_slots,
        )
        self.events.scheduler_made(self, scheduler)
        return scheduler

    def _adopt_role(self, info: engine_pb2.EngineInfo) -> None:
        """Check the engine's role against the one this link drives (EngineMismatch); the
        scheduler plans for it (scheduler/disagg/handoffs.py)."""
        assert self.scheduler is not None
        role = info.engine_role or "both"
        if role != self.role:
            listed = "--prefill-engine-address" if self.role == "prefill" else "--engine-address"
            raise EngineMismatch(
                f"the engine at {self.address} has engine_role={role!r}; it is listed as a "
                f"{self.role!r} engine ({listed})"
            )
        self.scheduler.transfers.role = role
        self.scheduler.transfers.block_bytes = info.kv_block_bytes
        self.events.engine_up(self)

    def _report_kv_moves(self, scheduler: Scheduler) -> None:
        if scheduler.transfers.moves:
            moves, scheduler.transfers.moves = scheduler.transfers.moves, []
            self.telemetry.on_kv_moves(moves)

    async def add_lora(
        self, name: str, path: str, replace: bool = False
    ) -> engine_pb2.AddLoraResponse:
        """Have the engine check adapter name at path (AioRpcError INVALID_ARGUMENT naming it
        and the reason when it refuses it), then serve it: under a new version when replacing
        (scheduler/lora.py), which the engine checks and caches under its key."""
        assert self.scheduler is not None and self.engine_stub is not None
        key = self.scheduler.loras.next_key(name, path, replace)
        added = await self.engine_stub.AddLora(
            engine_pb2.AddLoraRequest(lora_name=key, path=path),
            timeout=60,
            metadata=self.config.peer_metadata(),
        )
        self.scheduler.loras.register(name, path, replace)
        log.info("lora loaded", lora_name=name, key=key, path=path, rank=added.rank)
        return added

    async def _add_configured_loras(self) -> None:
        """--lora-modules not served yet (at the first connection), each checked by the
        engine; one it refuses is logged with the reason and left out, the others serve."""
        assert self.scheduler is not None
        if not self.scheduler.loras.max_loras:
            if self.config.lora_modules:
                log.error("lora modules ignored: the engine has --max-loras 0")
            return
        for name, path in self.config.lora_paths().items():
            if name in self.scheduler.loras.paths:
                continue
            try:
                await self.add_lora(name, path)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
                log.error("lora refused", lora_name=name, path=path, why=err.details())

    def _set_ready(self, ready: bool) -> None:
        self.ready = ready
        self.been_ready = self.been_ready or ready
        self.events.health_changed()

    @contextlib.asynccontextmanager
    async def _heartbeat(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncIterator[None]:
        """Watch the engine's heartbeat over channel while the block runs."""
        task = asyncio.create_task(self.watch_engine(channel, metadata))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def watch_engine(
        self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        """Probe the engine's health every HEARTBEAT_S; a probe unanswered within HEARTBEAT_S
        (with no step result meanwhile) is a missed beat. Sets engine_responding, False after
        MAX_MISSED_HEARTBEATS missed beats in a row, True at the next answer."""
        stub = health_pb2_grpc.HealthStub(channel)
        missed = 0
        while not self.stopping:
            start = time.monotonic()
            try:
                reply = await stub.Check(
                    health_pb2.HealthCheckRequest(), timeout=HEARTBEAT_S, metadata=metadata
                )
                answered = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                answered = False
            missed = 0 if answered or self.last_result_at > start else missed + 1
            self._on_heartbeat(missed < MAX_MISSED_HEARTBEATS, missed)
            await asyncio.sleep(max(0.0, HEARTBEAT_S - (time.monotonic() - start)))

    def _on_heartbeat(self, responding: bool, missed: int) -> None:
        if responding == self.engine_responding:
            return
        self.engine_responding = responding
        if self.ready and not responding:
            log.warning("engine not answering; not ready until it does", missed_beats=missed)
        elif self.ready:
            log.info("engine answering again; ready")
        self.events.health_changed()

    async def _step_loop(
        self, stub: engine_pb2_grpc.EngineStub, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        """Keep up to 1 step in flight (2 overlapping; P for an engine of more pipeline stages):
        while there is room and work, plan and send; else read the oldest step's result; with
        nothing in flight and nothing to plan, sleep until a Submit or a cancellation wakes the
        loop."""
        assert self.scheduler is not None
        scheduler = self.scheduler
        # Speculation: one step at a time, since how many tokens a step adds to each request
        # is known only from its result, and the next step's positions depend on it.
        overlap = self.config.overlap_scheduling and not scheduler.speculation.enabled
        depth = max(2 if overlap else 1, scheduler.pipeline_parallel_size)
        in_flight: deque[SentStep] = deque()
        call = stub.Step(metadata=metadata)
        # Completes when the stream ends (the engine died, or closed it): an idle loop notices
        # at once, not at its next write, so a restarted engine at the same address is not
        # sent a plan on the dead stream (nor taken for up by the heartbeat meanwhile).
        ended = asyncio.ensure_future(call.code())
        self._set_ready(True)
        try:
            while not self.stopping:
                if len(in_flight) < depth and scheduler.has_work:
                    sent = await self._send_step(scheduler, call)
                    if sent is not None:
                        in_flight.append(sent)
                        continue
                if in_flight:
                    await self._read_result(scheduler, call, in_flight.popleft())
                    continue
                # No await since the scheduler last had nothing to do: no wakeup is missed.
                self.wakeup.clear()
                # Sleep until woken, until a static batch forming is due (timeout None: never),
                # or until the stream ends.
                woken = asyncio.ensure_future(self.wakeup.wait())
                await asyncio.wait(
                    {woken, ended}, timeout=scheduler.idle_timeout_s(),
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                woken.cancel()
                if ended.done() and not self.stopping:
                    raise EngineLost(f"the Step stream ended while idle ({ended.result()})")
        finally:
            ended.cancel()
            call.cancel()

    async def _send_step(self, scheduler: Scheduler, call: Any) -> SentStep | None:
        """Plan a step and write it to the engine; None (with no await) if the plan is empty."""
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        t1 = time.perf_counter()
        self._report_kv_moves(scheduler)
        if plan.is_empty:
            return None
        for request in plan.preempted:
            log.info(
                "request preempted",
                request_id=request.request_id,
                trace_id=self.telemetry.trace_id(request),
                reason=request.preemption.reason,
                tenant=request.tenant,
                num_preemptions=request.num_preemptions,
            )
        plan_msg = plan_to_proto(plan)
        plan_msg.trace_context.update(self.telemetry.on_plan(plan))
        await call.write(plan_msg)
        return SentStep(plan, t0, t1)

    async def _read_result(self, scheduler: Scheduler, call: Any, sent: SentStep) -> None:
        """Read the result of the oldest step in flight, apply it, stream its tokens out."""
        result = await call.read()
        t2 = time.perf_counter()
        self.last_result_at = time.monotonic()
        if result is grpc.aio.EOF:
            raise EngineLost("engine closed the stream")
        plan = sent.plan
        assert result.step_id == plan.step_id, f"result {result.step_id} for plan {plan.step_id}"
        for seq_id, reason in zip(result.refused_seq_ids, result.refusal_reasons, strict=True):
            request = scheduler.abort(seq_id)  # its rows' tokens are then ignored by update
            if request is not None:
                log.warning("engine refused a request", request_id=request.request_id, why=reason)
                deliver(
                    self.streams, StepOutcome(request, None, None, request.status, error=reason)
                )
        outcomes = apply_result(scheduler, plan, result)
        for outcome in outcomes:
            deliver(self.streams, outcome)
        self.events.result_applied(self)
        self._report_kv_moves(scheduler)
        t3 = time.perf_counter()
        t0, t1 = sent.t_plan, sent.t_planned
        timings = {
            "schedule_ms": (t1 - t0) * 1e3,
            "step_rtt_ms": (t2 - t1) * 1e3,
            "update_ms": (t3 - t2) * 1e3,
            "engine_forward_ms": result.forward_ms,
            "engine_sample_ms": result.sample_ms,
        }
        self.telemetry.on_result(plan, outcomes, {"step_s": t3 - t0, **timings})
        for name, ms in {**timings, "engine_total_ms": result.total_ms}.items():
            setattr(self.times, name, getattr(self.times, name) + ms)
