"""The scheduler service's link to a prefill engine (prefill / decode disaggregation,
docs/disaggregation.md): a second engine loop, with its own Scheduler over the prefill engine's
pool, inside the service that drives the decode engine. Both loops run on the service's one
asyncio loop, so a handoff (the prefill side's result with a request's first token, then the
decode side's blocks and transfer, then the send in the next prefill plan) happens between two
awaits, with no agreement to reach between two owners.

If the prefill engine is lost, its requests (waiting, and running ones reset_engine preempted)
move to the decode scheduler, which recomputes their prompts, and new requests go there too
until the prefill engine is back; transfers in flight are given up at once (their requests
recompute on the decode side). If the decode engine is lost, its requests move to the prefill
scheduler, which runs them whole (prompt and decode: role "both") until the decode engine is
back, and new requests too; those it runs then finish there. Nothing already streamed is
streamed again: a request leaves either side with every token it streamed in its tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from grpc_health.v1 import health

from common.log import get_logger
from scheduler.engine_loop import EngineLoop, StepTimes

log = get_logger("scheduler")

# The prefill scheduler's first step id: its steps and the decode scheduler's share the
# service's telemetry, which keys steps in flight by id.
PREFILL_FIRST_STEP_ID = 1 << 40


class PrefillLink(EngineLoop):
    def __init__(self, service: EngineLoop):
        """service: the SchedulerService, whose own link drives the decode engine."""
        self.service = service
        self.config = replace(service.config, engine_address=service.config.prefill_engine_address)
        self.scheduler = None
        self.engine_info = None
        self.engine_stub = None
        self.streams = service.streams  # one stream per request, whichever side runs it
        self.wakeup = asyncio.Event()
        self.ready = False
        self.engine_responding = True
        self.last_result_at = 0.0
        self.draining = False
        self.stopping = False  # set with the service's (SchedulerService.shutdown)
        self.times = StepTimes()
        self.telemetry = service.telemetry
        self.num_engine_resets = 0
        self.health = health.aio.HealthServicer()  # its own; the service's reflects both links
        self._health_update = None

    @property
    def engine_role(self) -> str:
        return "prefill"

    @property
    def takes_requests(self) -> bool:
        """Whether new requests start here (else on the decode side)."""
        return self.scheduler is not None and self.ready and self.engine_responding

    def _update_health(self) -> None:
        self.service._update_health()

    def _on_engine_info(self, info: Any) -> None:
        first = self.scheduler is None
        super()._on_engine_info(info)
        if first:
            assert self.scheduler is not None
            self.scheduler.next_step_id = PREFILL_FIRST_STEP_ID

    def _after_result(self) -> None:
        """Hand the requests whose first token came to the decode side: it takes blocks for
        what its prefix cache lacks and the transfer's send goes in this side's next plan."""
        assert self.scheduler is not None
        handoffs = self.scheduler.take_handoffs()
        if not handoffs:
            return
        decode, service = self.service.scheduler, self.service
        assert decode is not None
        info = service.engine_info
        address = info.kv_transfer_address if info is not None and service.ready else ""
        same_blocks = info is not None and info.block_size == self.scheduler.block_size
        for request, blocks in handoffs:
            to_send = decode.receive(request, blocks if address and same_blocks else [])
            if to_send:
                transfer_id = decode.transfers.by_seq_id[request.seq_id]
                self.scheduler.queue_send(transfer_id, to_send, address)
        self.wakeup.set()
        service.wakeup.set()

    def take_over(self) -> None:
        """The decode engine was lost (its Scheduler reset: every request of it waits): run its
        requests, and new ones, whole here until it is back (`decode_back`)."""
        decode = self.service.scheduler
        if self.scheduler is None or decode is None or not self.takes_requests:
            return  # nobody can take them: they wait for the decode engine
        self.scheduler.transfers.role = "both"
        self.scheduler.transfers.forget_plan_parts()  # sends to the lost engine: nobody awaits
        moved = list(decode.waiting)
        for request in moved:
            decode.release(request)
            self.scheduler.receive(request, [])
        log.warning(
            "decode engine lost: the prefill engine runs requests whole until it is back",
            num_requests_moved=len(moved),
        )
        self.wakeup.set()

    def decode_back(self) -> None:
        """The decode engine is (back) up: prompts hand off again (a request this side took
        whole and has sampled for already finishes here)."""
        if self.scheduler is not None:
            self.scheduler.transfers.role = "prefill"

    def _after_reset(self) -> None:
        """The prefill engine was lost: its requests and transfers go to the decode side."""
        assert self.scheduler is not None
        decode = self.service.scheduler
        self.scheduler.transfers.forget_plan_parts()
        if decode is None:
            return
        failed = decode.fail_transfers("prefill_lost")
        moved = list(self.scheduler.waiting)
        for request in moved:
            self.scheduler.release(request)
            decode.receive(request, [])
        if failed or moved:
            log.warning(
                "prefill engine lost: its requests recompute on the decode engine",
                num_transfers_failed=len(failed),
                num_requests_moved=len(moved),
            )
        self.service.wakeup.set()
