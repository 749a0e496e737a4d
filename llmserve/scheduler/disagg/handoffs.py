"""Prefill / decode disaggregation in planning (`scheduler.handoffs`; docs/disaggregation.md).
One scheduler service holds a Scheduler per engine, each of role "prefill" or "decode". A
request runs its prompt on the prefill side; the step that samples its first token hands it off
(its blocks freed and cached there, a send in the next plan); the decode side pins fresh blocks
for the prompt's full blocks its own prefix cache lacks, puts a receive in its next plan, and
once the engine reports the arrival admits the request as a prefix hit. Only full blocks move;
a failed transfer admits the request as a miss (recompute). The first token is never sampled or
streamed again. Bookkeeping: scheduler/disagg/transfers.py; the steps:
docs/disaggregation.md#how-a-request-runs.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from llmserve.common.step_plan import KVSend
from llmserve.scheduler.disagg.transfers import Transfer
from llmserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from llmserve.scheduler.scheduler import Scheduler


class Handoffs:
    """One Scheduler's side of prefill / decode disaggregation: requests it hands off (role
    "prefill") or receives (role "decode"), and their KV transfers (`transfers`)."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    # -- the prefill side ---------------------------------------------------------------------

    def hands_off(self, request: Request) -> bool:
        """Whether request's token just taken is its first on a prefill scheduler (and did not
        end it): it then leaves for the decode side."""
        return self.s.transfers.role == "prefill" and request.num_output_tokens == 1

    def stops_at_first_token(self, request: Request) -> bool:
        """On a prefill scheduler, a request whose first token is pending needs no more steps
        here (it is handed off when the token comes)."""
        return self.s.transfers.role == "prefill" and (
            request.num_output_tokens + request.num_pending_tokens >= 1
        )

    def hand_off(self, request: Request) -> None:
        """request (running, its first token taken) leaves this prefill scheduler: its blocks
        are freed (kept in the prefix cache here) and it is listed, with its prompt's full
        blocks, in `transfers.handoffs` for the service to give to the decode side. The send,
        if the decode side asks for one, reads the blocks before any later forward here writes
        them (the engine runs a plan's sends first)."""
        full_blocks = request.block_table[: request.num_prompt_tokens // self.s.block_size]
        self.s.running.remove(request)
        self.s.block_manager.free(request)
        del self.s.requests[request.seq_id]
        self.s.tenants.leave(request.tenant)
        self.s.drop_from_engine(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0
        request.pipeline.slot = None
        self.s.transfers.handoffs.append((request, list(full_blocks)))

    def take(self) -> list[tuple[Request, list[int]]]:
        handoffs, self.s.transfers.handoffs = self.s.transfers.handoffs, []
        return handoffs

    def queue_send(self, transfer_id: int, block_ids: list[int], address: str) -> None:
        """The next plan sends block_ids of this pool to the decode engine at address."""
        self.s.transfers.sends.append(KVSend(transfer_id, block_ids, address))

    def release(self, request: Request) -> None:
        """Take waiting request out of this scheduler (it runs elsewhere now: the prefill
        engine was lost and the decode side takes over its prompt)."""
        assert request.status == RequestStatus.WAITING and request.seq_id in self.s.requests
        self.s.waiting.remove(request)
        del self.s.requests[request.seq_id]
        self.s.block_manager.unpin(request.seq_id)
        self.s.tenants.leave(request.tenant)
        request.mirror.in_engine = False
        request.pipeline.slot = None

    # -- the decode side ----------------------------------------------------------------------

    def receive(self, request: Request, source_blocks: list[int], source: str = "") -> list[int]:
        """Take request, handed off by the prefill engine at source with its prompt's full
        blocks there (source_blocks), into this scheduler (a decode one; or any, with no
        blocks: a request moved from an engine that was lost). The blocks this pool's prefix
        cache lacks get fresh blocks pinned for them and a transfer (its receive goes in the
        next plan);
        returns the prefill blocks to send, in order ([]: nothing to move; it waits to be
        admitted at once, recomputing what it lacks)."""
        assert request.seq_id not in self.s.requests, f"seq_id {request.seq_id} taken twice"
        self.s.requests[request.seq_id] = request
        self.s.tenants.arrive(request.tenant, request.tenant_weight)
        request.block_hashes = []  # hashed by this pool's block size
        bm = self.s.block_manager
        cached = bm.find_cached_blocks(request)
        keys = bm.keys_after(request, len(cached))[: max(0, len(source_blocks) - len(cached))]
        room = bm.num_free_blocks - sum(1 for b in cached if bm.ref_cnt[b] == 0)
        keys = keys[: max(0, room)]
        if not keys:
            self.s.waiting.append(request)
            return []
        bm.pin(request.seq_id, cached)
        now = time.monotonic()
        transfer = Transfer(
            next(self.s.transfers.ids), request, bm.pin_fresh(request.seq_id, len(keys)), keys,
            now, now + self.s.transfers.timeout_s, source,
        )  # fmt: skip
        self.s.transfers.start(transfer)
        return source_blocks[len(cached) : len(cached) + len(keys)]

    def on_received(self, transfer_ids: list[int]) -> None:
        """The decode engine wrote these transfers into the pool: their blocks enter the prefix
        cache and their requests wait to be admitted (still pinned: a hit). Ids no longer in
        flight (given up meanwhile) are ignored: their blocks were freed, and are rewritten by
        whoever holds them now."""
        now = time.monotonic()
        for transfer_id in transfer_ids:
            transfer = self.s.transfers.in_flight.get(transfer_id)
            if transfer is None:
                continue
            for block_id, key in zip(transfer.block_ids, transfer.keys, strict=True):
                self.s.block_manager.cache_block(block_id, key)
            self.s.transfers.end(transfer, None, now)
            self.s.waiting.append(transfer.request)

    def fail(
        self,
        reason: str,
        *,
        deadline_only: bool = False,
        transfer_ids: list[int] | None = None,
        source: str | None = None,
    ) -> list[Request]:
        """Give up the transfers in flight (only those past their deadline, with
        deadline_only; only transfer_ids, when given; only those from the prefill engine at
        source, when given): their blocks are freed and their requests wait to be admitted as
        misses (recompute here). Returns those requests."""
        now = time.monotonic()
        failed = []
        for transfer in list(self.s.transfers.in_flight.values()):
            if deadline_only and now < transfer.deadline:
                continue
            if transfer_ids is not None and transfer.transfer_id not in transfer_ids:
                continue
            if source is not None and transfer.source != source:
                continue
            self.s.transfers.end(transfer, reason, now)
            self.s.block_manager.unpin(transfer.request.seq_id)
            self.s.waiting.append(transfer.request)
            failed.append(transfer.request)
        return failed

    def cancel(self, request: Request) -> bool:
        """If request waits for a transfer, give it up (it is being aborted): True."""
        transfer = self.s.transfers.of(request.seq_id)
        if transfer is None:
            return False
        self.s.transfers.end(transfer, "cancelled", time.monotonic())
        self.s.block_manager.unpin(request.seq_id)
        return True

    def take_plan_parts(self) -> dict[str, object]:
        """The next plan's transfer parts, as StepPlan's fields."""
        sends, receives, cancels = self.s.transfers.take_plan_parts()
        return {
            "kv_sends": sends,
            "kv_receives": receives,
            "kv_receive_cancels": cancels,
            "awaits_transfers": bool(self.s.transfers.in_flight),
        }
