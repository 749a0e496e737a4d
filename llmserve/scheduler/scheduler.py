"""Iteration-level scheduling: each call to `schedule` plans one engine step.

Every running request catches its `num_computed_tokens` up to `num_tokens` a chunk at a time, so
prefill, chunked prefill, decode and prefix-cache hits are one mechanism: a step gives each request
some tokens out of the token budget. Running requests go first (oldest first); waiting requests are
admitted with what budget and blocks are left. When blocks run out, the newest running request is
preempted: its blocks are freed and it waits again, to be recomputed from its tokens later. (The
fair and priority policies change the admission order and whom preemption picks, through hooks.)

Pipeline slots (P > 1 engine stages): scheduler/pipeline.py. Preemption's victims:
scheduler/policies/base.py. Step results: scheduler/results.py. The plan: scheduler/plan.py.

Static batching, the baseline continuous batching is measured against, is a subclass with its own
hooks (scheduler/policies/static_batching.py).
"""

from __future__ import annotations

import time

from llmserve.common.choice_id import names_request
from llmserve.scheduler.admin import RequestRow, TenantRow, request_rows, tenant_rows
from llmserve.scheduler.block_manager import BlockManager
from llmserve.scheduler.pipeline import PipelineSlots
from llmserve.scheduler.plan import StepPlan, make_plan
from llmserve.scheduler.policies.base import Preemption
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.results import StepResults


class AdmissionError(Exception):
    """A request refused at admission. `code` is a gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Scheduler(StepResults, Preemption, PipelineSlots):
    """Continuous batching in arrival order (fcfs). A subclass changes the policy through the
    hooks: `_next_waiting` (admission order), `_may_admit` (the admission gate),
    `_victim_order` (who is preempted first), `_room_candidates` (whom a waiting request may
    displace), `_on_stopped` (what a finished request becomes), `_evict` (who gives up blocks),
    `_is_padding` and `_on_token` (rows that run on without streaming). The fair and priority
    policies are scheduler/policies/fair.py and scheduler/policies/priority.py; static batching is
    scheduler/policies/static_batching.py.

    Bounded preemption, every policy: a running request preempted max_preemptions times, or
    admitted fewer than preemption_grace_steps steps ago, is protected: no one chooses it as a
    victim (each refusal is counted). A running request short of a block that finds only
    protected requests ranked below it preempts itself, so a step always makes progress."""

    # -- admission ------------------------------------------------------------------------------

    def check_admissible(self, request: Request) -> None:
        """Raise AdmissionError if request can never run or the queue is full. Changes nothing."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise AdmissionError("INVALID_ARGUMENT", "prompt_token_ids is empty")
        for name, ids in (
            ("prompt_token_ids", request.prompt_token_ids),
            ("stop_token_ids", sorted(request.stop_token_ids)),
        ):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise AdmissionError(
                    "INVALID_ARGUMENT",
                    f"{name} contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})",
                )
        if request.max_tokens < 1:
            raise AdmissionError(
                "INVALID_ARGUMENT", f"max_tokens={request.max_tokens} must be >= 1"
            )
        total = num_prompt + request.max_tokens
        what = f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) = {total}"
        if total > self.max_model_len:
            raise AdmissionError(
                "INVALID_ARGUMENT", f"{what} exceeds max_model_len={self.max_model_len}"
            )
        capacity = self.block_manager.num_blocks * self.block_size
        if total > capacity:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"{what} exceeds the KV cache's capacity of {capacity} tokens "
                f"({self.block_manager.num_blocks} blocks x {self.block_size})",
            )
        self._check_lora(request)
        if self.num_waiting >= self.config.max_waiting:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"queue full: {self.num_waiting} requests waiting (max_waiting="
                f"{self.config.max_waiting}); retry after a short delay",
            )

    def _check_lora(self, request: Request) -> None:
        """NOT_FOUND for an adapter that is not registered (or was unloaded)."""
        name = request.lora_name
        if name and not self.loras.is_servable(name):
            known = sorted(n for n in self.loras.paths if self.loras.is_servable(n))
            listed = ", ".join(known[:10]) + (f", and {len(known) - 10} more" * (len(known) > 10))
            raise AdmissionError(
                "NOT_FOUND", f"adapter {name!r} is not loaded (adapters: {listed or 'none'})"
            )

    def add(self, request: Request) -> None:
        """Queue request (after check_admissible). It runs from a later `schedule`."""
        name = request.lora_name
        if name and not request.lora_key and self.loras.is_servable(name):
            request.lora_key = self.loras.key_of(name)  # the version it runs on to the end
        self.check_admissible(request)
        assert request.seq_id not in self.requests, f"seq_id {request.seq_id} reused"
        request.arrival_time = request.arrival_time or time.monotonic()
        self.requests[request.seq_id] = request
        self.tenants.arrive(request.tenant, request.tenant_weight)
        if self.grammar_wait.must_hold(request):
            self.grammar_wait.hold(request)  # the line once the engine has its grammar
        else:
            self.waiting.append(request)

    def abort(self, seq_id: int) -> Request | None:
        """End a request wherever it is; its blocks are free on return. Unknown ids are ignored."""
        request = self.requests.get(seq_id)
        if request is None:
            return None
        if self._cancel_transfer(request):
            pass  # it waited for its KV blocks, not in the queue
        elif request.status == RequestStatus.WAITING:
            if not self.grammar_wait.remove(request):
                self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def find(self, request_id: str) -> list[Request]:
        """The requests (choices) of request_id: the one of that id, and those the gateway named
        `{request_id}-{index}` for a request of several choices (gateway/choices.py)."""
        return [r for r in self.requests.values() if names_request(request_id, r.request_id)]

    def list_requests(self, tenant: str = "") -> list[RequestRow]:
        """Every request held (running, then waiting in line order), or only tenant's."""
        held = self.grammar_wait.held.values()
        return request_rows([*self.running, *self.waiting, *held], tenant)

    def tenant_rows(self) -> list[TenantRow]:
        """Every tenant seen since start, with its queue, seats, blocks and service."""
        waiting = [*self.waiting, *self.grammar_wait.held.values()]
        return tenant_rows(self.tenants, waiting, self.running)

    def reset_engine(self) -> list[Request]:
        """The engine lost its mirror and KV pool (it restarted, or failed a step): preempt every
        running request and forget the prefix cache, so all work is redone from tokens. Steps in
        flight are lost with their results, and KV transfers into the pool with the pool (their
        requests recompute). Returns the requests preempted."""
        self.fail_transfers("decode_lost")
        self.transfers.forget_plan_parts()
        for request in reversed(self.running):
            self._preempt(request, "engine_reset")
        self.running = []
        self.finished_seq_ids = []
        self.last_result_step_id = self.next_step_id - 1
        for request in self.waiting:
            request.mirror.in_engine = False
        self.grammar_wait.reset()  # the engine may be a new process, its grammar cache empty
        for request in [r for r in self.waiting if self.grammar_wait.must_hold(r)]:
            self.waiting.remove(request)
            self.grammar_wait.hold(request)
        self.block_manager.reset_prefix_cache()
        self.loras.resize(self.loras.max_loras)  # an engine that lost its mirror reloads them
        self.block_manager.check_integrity(list(self.requests.values()))
        preempted, self.preempted = self.preempted, []
        return preempted

    def resize(self, num_blocks: int, block_size: int) -> list[Request]:
        """Adopt a restarted engine's pool geometry. Only after reset_engine (nobody holds blocks).
        Waiting requests that no longer fit are aborted and returned."""
        if (num_blocks, block_size) == (self.block_manager.num_blocks, self.block_size):
            return []
        assert not self.running, "resize with running requests"
        self.block_size = block_size
        offload = self.block_manager.offload
        self.block_manager = BlockManager(
            num_blocks, block_size, self.config.enable_prefix_caching,
            self.block_manager.sliding_window, offload,
        )  # fmt: skip
        if offload is not None:
            offload.reset()  # blocks keyed by the old block size
        waiting = [*self.waiting, *self.grammar_wait.held.values()]
        for request in waiting:
            request.block_hashes = []  # hashed per block, so they depend on block_size
        capacity = num_blocks * block_size
        too_big = [r for r in waiting if r.num_prompt_tokens + r.max_tokens > capacity]
        for request in too_big:
            self.abort(request.seq_id)
        return too_big

    def idle_timeout_s(self) -> float | None:
        """How long the service may sleep with nothing to plan before planning again (None:
        until a request arrives or ends)."""
        return None

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step: choose requests and their token counts, allocate their blocks, preempt
        if needed. Advances each scheduled request's num_computed_tokens (the step is assumed to
        run) and gives each request the step samples for a pending token; the plan lists what the
        engine needs to know.

        May be called again before the previous plan's `update` (overlap: at most one plan
        outstanding then): a pending token is planned as the next step's input like a known
        one. A request that may not need another token once its pending ones land (they reach
        max_tokens or max_model_len) is not scheduled ahead; EOS and stop tokens cannot be
        foreseen, so a request can be scheduled one step past its end, and that step's token is
        dropped by `update`.

        With P > 1 pipeline stages the step serves the slot of its id, and nothing is planned on
        a pending token; any number of plans may be outstanding. A slot with nothing to run
        whose step admits nobody is passed over: the step id moves on to the next slot's, at
        most P - 1 times, so an empty plan means that no slot has anything to run now."""
        if self.transfers.in_flight:
            self.fail_transfers("deadline", deadline_only=True)
        scheduled = self._schedule_step()
        for _ in range(self.pipeline_parallel_size - 1):
            if scheduled:
                break
            self.next_step_id += 1  # this slot's step would be empty: the next slot's turn
            scheduled = self._schedule_step()
        plan = self._make_plan(scheduled)
        if not plan.is_empty:
            self.counters.num_steps += 1
            self.counters.num_scheduled_tokens += plan.num_scheduled_tokens
        return plan

    def _schedule_step(self) -> list[tuple[Request, int]]:
        """(request, tokens now) for the step with id next_step_id: running requests first, then
        waiting ones, unless someone was preempted for this plan (it would be readmitted)."""
        scheduled: list[tuple[Request, int]] = []
        demand = [r.lora_key for r in self.running if self._runs_now(r)]
        self.loras.begin_step(self.next_step_id, demand)
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled)
        if not self.preempted:
            self._schedule_waiting(budget, scheduled)
        return scheduled

    def _schedule_running(self, budget: int, scheduled: list[tuple[Request, int]]) -> int:
        """Schedule running requests, oldest first, out of budget; returns what is left."""
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not (
                self._may_need_a_step(request)
                and self._runs_now(request)
                and self.loras.admit(request.lora_key, running=True)
            ):
                i += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            request.spec.num_lookahead_tokens = self._lookahead(request, num_new, budget)
            while not self._allocate_running(request, num_new):
                if self._release_pins():
                    continue  # blocks held for swap-ins go before anyone is preempted
                victim, freed = self._evict(i, scheduled)
                if victim is request:
                    break
                budget += freed  # > 0: this step had scheduled it already
                i = self.running.index(request)  # the victim may have been before it
            else:
                scheduled.append((request, num_new))
                self._charge(request, num_new)
                budget -= num_new + request.spec.num_lookahead_tokens
                i += 1
        return budget

    def _allocate_running(self, request: Request, num_new: int) -> bool:
        """Blocks for num_new tokens and request's lookahead slots; lookahead never costs a
        preemption: without blocks for it, the request goes without (num_lookahead_tokens 0)."""
        if request.spec.num_lookahead_tokens:
            if self.block_manager.allocate_slots(
                request, num_new + request.spec.num_lookahead_tokens
            ):
                return True
            request.spec.num_lookahead_tokens = 0
        return self.block_manager.allocate_slots(request, num_new)

    def _lookahead(self, request: Request, num_new: int, budget: int) -> int:
        """Lookahead slots for running request, scheduled num_new tokens out of budget: only
        for a decode step on known tokens (it samples; nothing pending), and no more than its
        max_tokens, the context and the budget leave room for (the step returns up to one
        token more than its proposals)."""
        if self.speculation.num_speculative_tokens == 0 or self._is_padding(request):
            return 0
        decodes = request.num_computed_tokens + num_new == request.num_tokens
        if request.num_pending_tokens or not decodes:
            return 0
        limit = min(
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
            budget - num_new,
        )
        return self.speculation.lookahead(request, limit)

    def _may_need_a_step(self, request: Request) -> bool:
        """False when request's pending tokens will end it: they bring its output to max_tokens
        or its length to max_model_len (padding rows run past max_tokens)."""
        num_pending = request.num_pending_tokens
        if num_pending == 0:
            return True
        if self._stops_at_first_token(request):
            return False
        if len(request.token_ids) + num_pending >= self.max_model_len:
            return False
        return (
            self._is_padding(request)
            or request.num_output_tokens + num_pending < request.max_tokens
        )

    # -- admission order ------------------------------------------------------------------------

    def _next_waiting(self) -> Request:
        """The waiting request to admit next (hook). fcfs: the first in line."""
        return self.waiting[0]

    def _may_admit(self, request: Request) -> bool:
        """Whether waiting request (next in line) may be admitted this step (hook)."""
        return True

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        """Admit waiting requests in the policy's order (`_next_waiting`) while budget, seats,
        blocks and pipeline room last; stop at the first that cannot be admitted (or that was
        preempted while planning this step). A policy that lets a waiting request displace
        running ones (`_room_candidates`) preempts for its seat and blocks first."""
        room = self._slot_room()
        while self.waiting and budget > 0:
            request = self._next_waiting()
            if room == 0 or not self._may_admit(request) or self._in_flight(request):
                break
            if any(r is request for r in self.preempted):
                break
            if not self.loras.admit(request.lora_key, running=False):
                break  # its adapter has no slot this step: it leads the line next step
            while len(self.running) >= self.config.max_num_seqs:
                freed = self._make_room(request, scheduled)
                if freed is None:
                    return
                budget += freed
            cached = self.block_manager.find_cached_blocks(request)
            if self._start_swap_in(request, cached):
                break  # it waits for its blocks to come back; the next plan admits it
            num_cached = len(cached) * self.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            while not self.block_manager.allocate_slots(request, num_new, cached):
                short = self.block_manager.num_blocks_short(request, num_new, cached)
                freed = self._make_room(request, scheduled, short)
                if freed is None:
                    return
                budget += freed
                num_new = min(request.num_tokens - num_cached, budget)
            self._remove_waiting(request)
            self._admit(request, num_cached)
            scheduled.append((request, num_new))
            self._charge(request, num_new)
            budget -= num_new
            room -= 1

    def _remove_waiting(self, request: Request) -> None:
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:
            self.waiting.remove(request)

    def _charge(self, request: Request, num_new: int) -> None:
        """request is scheduled num_new tokens now: charge its tenant for the positions never
        charged before (scheduler/tenants.py)."""
        start = max(request.num_computed_tokens, request.ledger.num_charged_tokens)
        end = request.num_computed_tokens + num_new
        if end > start:
            self.tenants.charge(request.tenant, request.num_prompt_tokens, start, end)
            request.ledger.num_charged_tokens = end

    def _admit(self, request: Request, num_cached: int) -> None:
        """request leaves the queue with num_cached tokens found in the prefix cache."""
        assert request.num_pending_tokens == 0, f"{request.request_id}: pending while waiting"
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        self._end_swap_in(request)
        request.pipeline.slot = self.slot
        request.preemption.admitted_step_id = self.next_step_id
        c = self.counters
        if request.num_cached_tokens is None:  # first admission
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            c.num_prompt_tokens += request.num_prompt_tokens
        c.num_prefix_cache_query_tokens += request.num_tokens
        c.num_prefix_cache_hit_tokens += num_cached
        self.running.append(request)

    def _make_plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        """The plan for `scheduled` (request, tokens now), with the ids to drop and the
        requests preempted since the last plan (see plan.make_plan)."""
        plan = make_plan(self.next_step_id, self.finished_seq_ids, self.preempted, scheduled)
        plan.lora_loads = self.loras.take_loads()
        for row in plan.rows:
            row.lora_slot = self.loras.slot_of(row.request.lora_key)
        if self.block_manager.offload is not None:
            plan.kv_copies = self.block_manager.offload.take_copies()
        plan.grammar_compiles = self.grammar_wait.take_unsent()
        plan.asks_grammars = self.grammar_wait.awaiting_engine
        for name, value in self._take_plan_transfers().items():  # none colocated
            setattr(plan, name, value)
        self.next_step_id += 1
        self.finished_seq_ids, self.preempted = [], []
        return plan

    def check_integrity(self) -> None:
        """Assert the block manager's invariants and the slots': each running request holds a
        slot in [0, P), no waiting one does, and with P > 1 none has two tokens pending."""
        self.block_manager.check_integrity(list(self.requests.values()))
        num_slots = self.pipeline_parallel_size
        for r in self.running:
            assert r.pipeline.slot is not None and 0 <= r.pipeline.slot < num_slots, (
                f"{r.request_id}: pipeline_slot={r.pipeline.slot} with {num_slots} slots"
            )
            assert num_slots == 1 or r.num_pending_tokens <= 1, f"{r.request_id}: 2 pending"
        for r in self.waiting:
            assert r.pipeline.slot is None, f"waiting {r.request_id} holds a pipeline slot"
