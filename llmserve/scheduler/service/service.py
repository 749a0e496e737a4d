"""The scheduler's gRPC service: Submit streams and the admin RPCs for the gateway, over its
engine links (`links`: one EngineLink per engine, scheduler/service/engine_link.py; under prefill /
decode disaggregation `roles` holds them by role, scheduler/disagg/roles.py).

Everything runs on one asyncio loop, so the Scheduler is only touched between awaits: a Submit or a
cancellation can land while a step is in flight, and `update` copes (it skips requests that ended
meanwhile). If the engine stream breaks, every running request is preempted (to be recomputed) and
the loop reconnects; requests keep waiting, their streams open, nothing already sent is resent
(results of steps in flight are lost with the engine; their tokens are recomputed).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.common.auth import peer_interceptors
from llmserve.common.counters import add_into, summed
from llmserve.common.log import bind, get_logger
from llmserve.common.net import LIVENESS_SERVICE, SERVER_OPTIONS, add_servicer, serve_aio
from llmserve.common.sampling import SamplingError
from llmserve.protos import scheduler_pb2, scheduler_pb2_grpc
from llmserve.scheduler.admission import AdmissionError
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.disagg.roles import Roles
from llmserve.scheduler.lora import check_lora_name
from llmserve.scheduler.plan import StepOutcome
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import (
    request_from_proto,
    request_state_to_proto,
    response_to_proto,
    stats_to_proto,
)
from llmserve.scheduler.service.engine_link import EngineLink, deliver
from llmserve.scheduler.service.telemetry import SchedulerTelemetry

log = get_logger("scheduler")

DEFAULT_STATS_INTERVAL_MS = 250  # WatchStats' period when the caller asks for none
MIN_STATS_INTERVAL_MS = 10


class SchedulerService(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.streams: dict[int, asyncio.Queue[StepOutcome]] = {}  # one per request
        self.telemetry = SchedulerTelemetry(self.stats)
        self.seq_ids = itertools.count(1)
        # Drain: admit nothing new (Submit: UNAVAILABLE, readiness NOT_SERVING); the rest goes on.
        self.draining = False
        self.stopping = False
        self.health = health.aio.HealthServicer()
        self._health_update: asyncio.Future[None] | None = None
        role = "decode" if config.prefill_engine_address else "both"
        first = EngineLink(
            config, role, config.engine_address[0], self.streams, self.telemetry, self
        )
        # Disaggregated: the prefill engines and the decode engines, by role (the first decode
        # engine's link is `link`, whose Scheduler GetInfo describes).
        self.roles = Roles(first, self) if config.prefill_engine_address else None
        self.links: list[EngineLink] = self.roles.links if self.roles is not None else [first]
        self.link = first

    @property
    def scheduler(self) -> Scheduler | None:
        """The first (or only) engine's Scheduler."""
        return self.link.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler | None) -> None:
        self.link.scheduler = scheduler

    def schedulers(self) -> list[Scheduler]:
        """The Schedulers holding requests: every engine's (the first decode or only engine's
        first)."""
        return [link.scheduler for link in self.links if link.scheduler is not None]

    def _wake(self) -> None:
        for link in self.links:
            link.wakeup.set()

    async def run_engine_loop(self) -> None:
        """Drive every engine."""
        await asyncio.gather(*(link.run() for link in self.links))

    @property
    def serving(self) -> bool:
        """Whether to take new requests (stats' `ready`, readiness): not draining, and the
        engine up (its Step stream open, answering its heartbeat). Disaggregated: every engine
        has been up once, and one is up (while some are lost, the others take their requests:
        scheduler/disagg/roles.py)."""
        if self.draining:
            return False
        if self.roles is None:
            return self.link.ready and self.link.engine_responding
        return self.roles.connected() and self.roles.any_up()

    # -- what the links report (LinkEvents) -----------------------------------------------------

    def scheduler_made(self, link: EngineLink, scheduler: Scheduler) -> None:
        if self.roles is not None:  # each engine's steps and transfers numbered apart
            self.roles.first_ids(link, scheduler)

    def engine_up(self, link: EngineLink) -> None:
        if self.roles is not None:
            self.roles.back(link)

    def result_applied(self, link: EngineLink) -> None:
        if self.roles is not None and link.role == "prefill":
            self.roles.hand_off(link)

    def engine_lost(self, link: EngineLink) -> None:
        if self.roles is not None:  # its requests move to other engines
            self.roles.lost(link)

    def health_changed(self) -> None:
        """SERVING while `serving`; disaggregated, the roles follow the decode engines' health."""
        if self.roles is not None:
            self.roles.health_changed()
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if self.serving else response.NOT_SERVING
        self._health_update = asyncio.ensure_future(self.health.set("", status))

    # -- gateway-facing RPCs ------------------------------------------------------------------

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        if self.draining:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                "scheduler is draining: it admits no new requests; send to another replica",
            )
        target = self._submit_target()
        if target is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine not ready; retry shortly")
        assert target is not None
        try:
            req = request_from_proto(request, next(self.seq_ids))
            target.add(req)
        except SamplingError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except AdmissionError as err:
            await context.abort(grpc.StatusCode[err.code], err.message)
        trace_id = self.telemetry.on_submit(req, context.invocation_metadata())
        bind(request_id=req.request_id, trace_id=trace_id)
        queue: asyncio.Queue[StepOutcome] = asyncio.Queue()
        self.streams[req.seq_id] = queue
        self._wake()
        finished: RequestStatus | None = None
        first = True
        try:
            while finished is None:
                outcomes = [await queue.get()]
                while not queue.empty():  # the client fell behind: send what piled up at once
                    outcomes.append(queue.get_nowait())
                finished = outcomes[-1].finished
                if outcomes[-1].error is not None:
                    message = f"the engine refused the request: {outcomes[-1].error}"
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                yield response_to_proto(req, outcomes, first)
                first = False
        finally:
            self._end_stream(req, finished)

    def _submit_target(self) -> Scheduler | None:
        """The Scheduler a new request starts on (None: no engine takes requests now)."""
        if self.roles is not None:
            return self.roles.submit_target()
        return self.scheduler if self.link.ready else None

    def _end_stream(self, req: Request, finished: RequestStatus | None) -> None:
        self.streams.pop(req.seq_id, None)
        if finished is None and self.scheduler is not None:
            # Cancelled by the client (or its connection died): free the blocks now (on both
            # sides, disaggregated: a transfer it waits for is given up).
            for scheduler in self.schedulers():
                scheduler.abort(req.seq_id)
            self._wake()
            log.info("request cancelled", request_id=req.request_id)
        status = req.status if req.status.is_finished else RequestStatus.FINISHED_ABORTED
        self.telemetry.on_finish(req, status)
        log.info(
            "request finished",
            finish_reason=status.value,
            output_tokens=req.num_output_tokens,
            cached_tokens=req.num_cached_tokens or 0,
            preemptions=req.num_preemptions,
        )

    async def GetInfo(
        self, request: scheduler_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        info = self.link.engine_info
        if self.scheduler is None or info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine not connected yet")
        assert self.scheduler is not None and info is not None
        s = self.scheduler
        return scheduler_pb2.SchedulerInfo(
            model=info.model,
            max_model_len=s.max_model_len,
            vocab_size=s.vocab_size,
            eos_token_ids=sorted(s.eos_token_ids),
            block_size=s.block_size,
            num_blocks=s.block_manager.num_blocks,
            max_num_seqs=s.config.max_num_seqs,
            max_num_batched_tokens=s.config.max_num_batched_tokens,
            max_waiting=s.config.max_waiting,
            scheduling_policy=s.config.policy,
        )

    def stats(self) -> dict[str, Any]:
        """One snapshot of every count and gauge: GetStats and the metrics both read it."""
        link = self.link
        snapshot: dict[str, Any] = {"num_engine_resets": link.num_engine_resets, **vars(link.times)}
        s = self.scheduler
        if s is not None:
            snapshot.update(_counts(s))
            snapshot.update(
                tenants=s.tenant_rows(),
                draining=self.draining,
                num_running=len(s.running),
                num_waiting=s.num_waiting,
                num_free_blocks=s.block_manager.num_free_blocks,
                num_blocks=s.block_manager.num_blocks,
                num_state_slots=s.state_slots.num_slots,
                num_free_state_slots=s.state_slots.num_free_slots,
                num_state_snapshot_slots=s.state_slots.snapshots.num_slots,
                num_used_state_snapshot_slots=s.state_slots.snapshots.num_used_slots,
                kv_bytes_per_token=s.transfers.block_bytes // s.block_manager.block_size,
                lora_names=sorted(n for n in s.loras.paths if s.loras.is_servable(n)),
            )
            if s.block_manager.offload is not None:
                snapshot.update(s.block_manager.offload.stats())
            if self.roles is not None:
                self._roles_stats(snapshot)
        return snapshot

    def _roles_stats(self, snapshot: dict[str, Any]) -> None:
        """Disaggregated: snapshot (the first decode engine's) with every other engine's
        added: the decode engines' pools, queues, counters and transfers summed into the
        plain fields; the prefill engines' pools and queues into prefill_*, their requests
        (and those waiting for a transfer) counted in num_running and num_waiting too, their
        counters added (the prefix cache's: theirs alone, where prompts are computed; a decode
        engine's "hits" are mostly the blocks moved); every engine's offload tiers summed; a
        row per engine in `engines`."""
        assert self.roles is not None
        decodes = [d.scheduler for d in self.roles.decodes if d.scheduler is not None]
        prefills = [p.scheduler for p in self.roles.prefills if p.scheduler is not None]
        transfers = [d.transfers.stats() for d in decodes]
        for name in transfers[0]:
            snapshot[name] = summed([t[name] for t in transfers])
        tiers = [
            x.block_manager.offload.stats()
            for x in [*decodes, *prefills]
            if x.block_manager.offload
        ]
        for name in tiers[0] if tiers else ():
            snapshot[name] = summed([t[name] for t in tiers])
        for d in decodes[1:]:
            snapshot["num_running"] += len(d.running)
            snapshot["num_waiting"] += d.num_waiting
            snapshot["num_free_blocks"] += d.block_manager.num_free_blocks
            snapshot["num_blocks"] += d.block_manager.num_blocks
            add_into(snapshot, _counts(d))
        snapshot["num_waiting"] += snapshot["num_transferring"]
        snapshot["decode_ready"] = any(d.up for d in self.roles.decodes)
        snapshot["prefill_ready"] = any(p.up for p in self.roles.prefills)
        snapshot["num_engine_resets"] = sum(link.num_engine_resets for link in self.roles.links)
        snapshot["engines"] = [self._engine_row(link) for link in self.roles.links]
        if not prefills:
            return
        snapshot.update(
            prefill_num_free_blocks=sum(p.block_manager.num_free_blocks for p in prefills),
            prefill_num_blocks=sum(p.block_manager.num_blocks for p in prefills),
            prefill_num_running=sum(len(p.running) for p in prefills),
            prefill_num_waiting=sum(len(p.waiting) for p in prefills),
        )
        snapshot["num_running"] += snapshot["prefill_num_running"]
        snapshot["num_waiting"] += snapshot["prefill_num_waiting"]
        prefix_cache = ("num_prefix_cache_query_tokens", "num_prefix_cache_hit_tokens")
        for name in prefix_cache:
            snapshot[name] = 0
        for p in prefills:
            add_into(snapshot, _counts(p))

    @staticmethod
    def _engine_row(link: EngineLink) -> dict[str, Any]:
        s = link.scheduler
        row: dict[str, Any] = {"address": link.address, "role": link.role}
        row["ready"] = link.up
        if s is not None:
            row.update(
                num_running=len(s.running),
                num_waiting=s.num_waiting,
                num_transferring=len(s.transfers.in_flight),
                num_free_blocks=s.block_manager.num_free_blocks,
                num_blocks=s.block_manager.num_blocks,
                num_engine_resets=link.num_engine_resets,
            )
        return row

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        msg = stats_to_proto(self.stats())
        msg.ready = self.serving
        return msg

    async def WatchStats(
        self, request: scheduler_pb2.WatchStatsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SchedulerStats]:
        """GetStats' snapshot, with `ready`, now and then every interval_ms until the caller
        cancels (or this scheduler stops: the stream then ends)."""
        interval_ms = request.interval_ms or DEFAULT_STATS_INTERVAL_MS
        if interval_ms < MIN_STATS_INTERVAL_MS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"interval_ms={interval_ms} is below the minimum of {MIN_STATS_INTERVAL_MS}",
            )
        while not self.stopping:
            msg = stats_to_proto(self.stats())
            msg.ready = self.serving
            yield msg
            await asyncio.sleep(interval_ms / 1e3)

    # -- operator RPCs (the gateway's Admin service forwards them) -----------------------------

    async def LoadLora(
        self, request: scheduler_pb2.LoadLoraRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LoadLoraResponse:
        """Have the engine check the adapter, then serve it (scheduler/lora.py). Disaggregated:
        every engine connected checks it, and every engine's Scheduler serves it (one down
        loads it from its path when a step places it)."""
        if self.scheduler is None or self.link.engine_stub is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine not connected yet")
        assert self.scheduler is not None
        if not self.scheduler.loras.max_loras:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "the engine serves no LoRA adapters (started with --max-loras 0)",
            )
        why = self._refuse_lora(request)
        if why is not None:
            await context.abort(*why)
        links = self.links
        up = [link for link in links if link.engine_stub is not None and link.up]
        if not up:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no engine up to check it; retry")
        name, path, replace = request.lora_name, request.path, request.replace
        try:
            added = [await link.add_lora(name, path, replace) for link in up]
        except grpc.aio.AioRpcError as err:
            await context.abort(err.code(), err.details() or err.code().name)
        for link in links:
            if link not in up and link.scheduler is not None:
                link.scheduler.loras.register(name, path, replace)
        first = added[0]
        return scheduler_pb2.LoadLoraResponse(rank=first.rank, target_modules=first.target_modules)

    def _refuse_lora(self, request: scheduler_pb2.LoadLoraRequest) -> tuple[Any, str] | None:
        """(code, message) when LoadLora must refuse request before any engine reads it: a name
        outside the safe set, one served from another directory without `replace` (running
        requests would change weights under a silent replacement), or a registry at its
        bound."""
        assert self.scheduler is not None
        name, loras = request.lora_name, self.scheduler.loras
        if (why := check_lora_name(name)) is not None:
            return grpc.StatusCode.INVALID_ARGUMENT, why
        served = loras.is_servable(name)
        if served and loras.paths[name] != request.path and not request.replace:
            return grpc.StatusCode.ALREADY_EXISTS, (
                f"adapter {name!r} is already served from {loras.paths[name]}; set replace "
                "(llmserve admin load-lora --replace) to serve a new version: requests running "
                "on the old one finish on it"
            )
        num_served = sum(1 for n in loras.paths if loras.is_servable(n))
        limit = self.config.max_registered_loras
        if not served and num_served >= limit:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"{num_served} adapters served (max_registered_loras={limit}); unload one first"
            )
        return None

    async def UnloadLora(
        self, request: scheduler_pb2.UnloadLoraRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.UnloadLoraResponse:
        name = request.lora_name
        serving = [s for s in self.schedulers() if s.loras.is_servable(name)]
        if not serving:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not loaded")
        using = 0
        for s in serving:
            s.loras.unregister(name)
            using += sum(1 for r in s.requests.values() if r.lora_name == name)
        log.info("lora unloaded", lora_name=name, num_requests_using=using)
        return scheduler_pb2.UnloadLoraResponse(num_requests_using=using)

    async def ListRequests(
        self, request: scheduler_pb2.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListRequestsResponse:
        rows = [row for s in self.schedulers() for row in s.list_requests(request.tenant)]
        return scheduler_pb2.ListRequestsResponse(requests=map(request_state_to_proto, rows))

    async def AbortRequest(
        self, request: scheduler_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.AbortRequestResponse:
        """Abort every choice of request.request_id: their streams end with ABORT now, their
        blocks are free before the next step."""
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        found = [(s, r) for s in self.schedulers() for r in s.find(request.request_id)]
        for scheduler, req in found:
            scheduler.abort(req.seq_id)
            deliver(self.streams, StepOutcome(req, None, None, RequestStatus.FINISHED_ABORTED))
            log.info(
                "request aborted by an operator",
                request_id=req.request_id,
                trace_id=self.telemetry.trace_id(req),
            )
        self._wake()
        return scheduler_pb2.AbortRequestResponse(num_aborted=len(found))

    async def Drain(
        self, request: scheduler_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.DrainResponse:
        """Stop admitting (or, with resume, admit again). Returns at once."""
        draining = not request.resume
        if draining != self.draining:
            self.draining = draining
            s = self.scheduler
            log.info(
                "draining" if draining else "admitting again",
                num_running=len(s.running) if s else 0,
                num_waiting=s.num_waiting if s else 0,
            )
            self.health_changed()
        return scheduler_pb2.DrainResponse(draining=self.draining)

    async def shutdown(self) -> None:
        """Stop stepping; end every open stream with finish reason ABORT."""
        self.stopping = True
        for link in self.links:
            link.stopping = True
        self._wake()
        for scheduler in self.schedulers():
            for seq_id in list(scheduler.requests):
                request = scheduler.abort(seq_id)
                if request is not None:
                    outcome = StepOutcome(request, None, None, RequestStatus.FINISHED_ABORTED)
                    deliver(self.streams, outcome)


def _counts(s: Scheduler) -> dict[str, Any]:
    """A Scheduler's counters, flat (the speculation counters beside the rest) and copied."""
    counts = {k: copy.copy(v) for k, v in vars(s.counters).items() if k != "spec"}
    counts.update({k: copy.copy(v) for k, v in vars(s.counters.spec).items()})
    return counts


async def serve(config: SchedulerConfig) -> None:
    """Serve until SIGTERM / SIGINT (llmserve.cli.run_service has checked its exposure)."""
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=peer_interceptors(config))
    service = SchedulerService(config)
    add_servicer(scheduler_pb2_grpc.add_SchedulerServicer_to_server, service, server)
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, service.health, server)
    await service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    await service.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await serve_aio(
        server,
        "scheduler",
        config.host,
        config.port,
        service.run_engine_loop,
        service.shutdown,
        config.server_credentials(),
    )
