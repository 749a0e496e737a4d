"""Iteration-level scheduling: each call to `schedule` plans one engine step, and `update`
applies its result.

Every running request catches its `num_computed_tokens` up to `num_tokens` a chunk at a time, so
prefill, chunked prefill, decode and prefix-cache hits are one mechanism: a step gives each request
some tokens out of the token budget. Running requests go first (oldest first); waiting requests are
admitted with what budget and blocks are left. When blocks run out, the newest running request is
preempted: its blocks are freed and it waits again, to be recomputed from its tokens later.

The Scheduler holds its parts and calls them by name: `policy` (admission order and victims:
scheduler/policies/), `slots` (pipeline stages: scheduler/pipeline.py), `swaps` (KV offload tiers:
scheduler/swaps.py), `handoffs` (prefill / decode engines: scheduler/disagg/handoffs.py),
`block_manager`, `state_slots`, `loras`, `tenants`, `grammar_wait`, `speculation`. The plan it
returns: scheduler/plan.py.

Size: over 800 lines: what is left here is the request lifecycle its parts share (admission,
planning, results, preemption), each a few short methods calling those parts.
"""

from __future__ import annotations

import math
import time
from collections import deque

from llmserve.common.choice_id import names_request
from llmserve.scheduler.admin import (
    RequestRow,
    SchedulerCounters,
    TenantRow,
    request_rows,
    tenant_rows,
)
from llmserve.scheduler.admission import check_admissible
from llmserve.scheduler.block_manager import BlockManager
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.disagg.handoffs import Handoffs
from llmserve.scheduler.disagg.transfers import TransferTable
from llmserve.scheduler.grammar_wait import GrammarWait
from llmserve.scheduler.kv_offload import KVOffload
from llmserve.scheduler.lora import LoraTable
from llmserve.scheduler.pipeline import PipelineSlots
from llmserve.scheduler.plan import (
    NewRequestRow,
    RunningRow,
    StepOutcome,
    StepPlan,
    TopLogprobColumns,
    make_plan,
)
from llmserve.scheduler.policies import Policy, make_policy
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.speculation import SpeculationPolicy
from llmserve.scheduler.state_slots import StateSlots
from llmserve.scheduler.swaps import Swaps
from llmserve.scheduler.tenants import TenantLedger


class Scheduler:
    """Continuous batching under config's policy (fcfs, fair, priority or static).

    Bounded preemption, every policy: a running request preempted max_preemptions times, or
    admitted fewer than preemption_grace_steps steps ago, is protected: no one chooses it as a
    victim (each refusal is counted). A running request short of a block that finds only
    protected requests ranked below it preempts itself, so a step always makes progress."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        pipeline_parallel_size: int = 1,
        num_speculative_tokens: int = 0,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
        kv_block_bytes: int = 0,
        num_state_slots: int = 0,
        num_state_snapshot_slots: int = 0,
        policy: Policy | None = None,
    ):
        """policy: default config.policy's. num_speculative_tokens: the most tokens the engine
        proposes per request and step (0: none; with it, one step at a time: a step's tokens
        per request are known only from its result). num_host_blocks, num_disk_blocks: the
        engine's KV offload tiers (0: none; kv_offload.py), of kv_block_bytes each.
        num_state_slots, num_state_snapshot_slots: the engine's state slots (state_slots.py)."""
        assert config.max_num_seqs > 0 and config.max_num_batched_tokens > 0, (
            "a scheduler needs its step limits: SchedulerConfig.adopt the engine's first"
        )
        self.config, self.policy = config, policy or make_policy(config.policy)
        self.policy.bind(self)
        self.slots, self.swaps, self.handoffs = PipelineSlots(self), Swaps(self), Handoffs(self)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.state_slots = StateSlots(num_state_slots, num_state_snapshot_slots, block_size)
        self.block_manager = self._new_block_manager(num_blocks, block_size, None, None)
        self.set_offload_tiers(num_host_blocks, num_disk_blocks, kv_block_bytes)
        self.waiting: deque[Request] = deque()
        # Constrained requests whose grammar the engine has not compiled yet (they join
        # `waiting` once it has; scheduler/grammar_wait.py).
        self.grammar_wait = GrammarWait()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        # Requests the engine mirrors that it must drop before the next plan.
        self.finished_seq_ids: list[int] = []
        # Requests preempted since the last plan was made (they travel in the next plan).
        self.preempted: list[Request] = []
        self.next_step_id = 1
        # The newest step whose result `update` applied (or whose result reset_engine lost).
        self.last_result_step_id = 0
        self.set_pipeline_parallel_size(pipeline_parallel_size)
        self.speculation = SpeculationPolicy(0)
        self.set_num_speculative_tokens(num_speculative_tokens)
        self.counters = SchedulerCounters()
        self.tenants = TenantLedger(config.fair_prefill_weight, config.fair_decode_weight)
        # LoRA adapters: the registry and the engine's slot table (scheduler/lora.py); no slots
        # until an engine reports max_loras.
        self.loras = LoraTable()
        # Prefill / decode disaggregation: this scheduler's role and its transfers
        # (scheduler/disagg/handoffs.py); role "both" (colocated) uses none of it.
        self.transfers = TransferTable("both", config.kv_transfer_timeout_s)

    @property
    def enable_prefix_caching(self) -> bool:
        """The config's choice, except for a model with state layers without state snapshots:
        a cached block's KV is of no use without its state layers' state at that boundary
        (docs/architecture.md#state-snapshots)."""
        slots = self.state_slots
        return self.config.enable_prefix_caching and (not slots.enabled or slots.snapshots.enabled)

    def set_sliding_window(self, sliding_window: int | None) -> None:
        """Release running requests' blocks that fall out of this window (the engine's, when
        every layer of its model has it; None: never). Only with nothing running."""
        assert not self.running, "set_sliding_window with running requests"
        self.block_manager.sliding_window = sliding_window or None

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Give decode steps up to num_speculative_tokens lookahead slots from the next plan on.
        Raises ValueError with P > 1 pipeline stages (refused: a stage's step would wait for the
        previous one's token counts) or a negative count."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
        self.policy.check_engine(self.pipeline_parallel_size, num_speculative_tokens)
        if num_speculative_tokens and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative decoding needs pipeline_parallel_size=1, not "
                f"{self.pipeline_parallel_size}"
            )
        self.speculation = SpeculationPolicy(num_speculative_tokens)

    def set_pipeline_parallel_size(self, pipeline_parallel_size: int) -> None:
        """Plan for an engine of pipeline_parallel_size stages from the next step on. A change
        only while nothing runs (at start, or after reset_engine): running requests hold slots.
        Raises ValueError for a size below 1."""
        if pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} must be >= 1")
        self.policy.check_engine(pipeline_parallel_size, 0)
        if pipeline_parallel_size != self.slots.size:
            assert not self.running, "pipeline_parallel_size changed with running requests"
        self.slots.size = pipeline_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.slots.size

    def set_offload_tiers(
        self, num_host_blocks: int, num_disk_blocks: int, block_bytes: int = 0
    ) -> None:
        """Index an engine's KV offload tiers of these sizes (0 host blocks: none; block_bytes:
        one block's size, for the byte counts) from the next plan on. Only while nothing is
        pinned (at start, or after reset_engine). Offload needs the prefix cache: without it,
        none. Tiers of the same sizes keep their counters (their contents were forgotten by
        reset_engine)."""
        bm = self.block_manager
        assert not bm.pins, "offload tiers changed with blocks pinned"
        old = bm.offload
        sizes = (num_host_blocks, num_disk_blocks)
        if old is not None and (old.host.num_slots, old.disk.num_slots if old.disk else 0) == sizes:
            old.block_bytes = block_bytes
            return
        offload = None
        if num_host_blocks > 0 and bm.enable_prefix_caching and not self.state_slots.enabled:
            offload = KVOffload(num_host_blocks, num_disk_blocks, block_bytes)
        bm.offload = offload

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        request.status = status
        request.num_pending_tokens = 0  # results still in flight for it are ignored
        self.block_manager.unpin(request.seq_id)  # a swap-in it was waiting for
        self.block_manager.free(request)
        self.state_slots.free(request)
        del self.requests[request.seq_id]
        self.tenants.leave(request.tenant)
        self.drop_from_engine(request)
        self.counters.num_finished_requests += 1
        reasons = self.counters.finish_reasons
        reasons[status.value] = reasons.get(status.value, 0) + 1

    def drop_from_engine(self, request: Request) -> None:
        """If the engine's mirror holds request, list it for the next plan to drop."""
        if request.mirror.in_engine:
            self.finished_seq_ids.append(request.seq_id)
            request.mirror.in_engine = False

    @property
    def has_work(self) -> bool:
        """Whether to plan a step: requests to run or drop, or grammars to compile or to ask
        the engine about, or KV transfers under way."""
        return bool(
            self.waiting or self.running or self.finished_seq_ids or self.grammar_wait
            or self.transfers.has_work
        )  # fmt: skip

    @property
    def num_waiting(self) -> int:
        """Requests not running: in the waiting line, or held for their grammar."""
        return len(self.waiting) + len(self.grammar_wait)

    def grammars_compiled(self, seq_ids: list[int]) -> None:
        """The engine compiled the grammars of these held requests (a result's
        compiled_seq_ids): they join the waiting line. Unknown ids are ignored."""
        self.waiting.extend(self.grammar_wait.release(seq_ids))

    def grammar_dead_ends(self, seq_ids: list[int]) -> None:
        """The engine found these requests' constraints at a dead end (a result's
        dead_end_seq_ids): each ends at its next token, with that finish reason. Unknown ids (a
        request ended since) are ignored."""
        for seq_id in seq_ids:
            if (request := self.requests.get(seq_id)) is not None:
                request.grammar_dead_end = True

    # -- admission ------------------------------------------------------------------------------

    def check_admissible(self, request: Request) -> None:
        """Raise AdmissionError if request can never run or the queue is full (admission.py).
        Changes nothing."""
        check_admissible(self, request)

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
        self.policy.on_abort(seq_id)
        if self.handoffs.cancel(request):
            pass  # it waited for its KV blocks, not in the queue
        elif request.status == RequestStatus.WAITING:
            if not self.grammar_wait.remove(request):
                self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self.finish(request, RequestStatus.FINISHED_ABORTED)
        self.policy.after_abort()
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
        self.policy.on_reset()
        self.handoffs.fail("decode_lost")
        self.transfers.forget_plan_parts()
        for request in reversed(self.running):
            self.preempt(request, "engine_reset")
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
        self.state_slots.snapshots.reset()
        self.loras.resize(self.loras.max_loras)  # an engine that lost its mirror reloads them
        self.block_manager.check_integrity(list(self.requests.values()))
        preempted, self.preempted = self.preempted, []
        return preempted

    def resize(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        num_snapshot_slots: int = 0,
    ) -> list[Request]:
        """Adopt a restarted engine's pool geometry (and state and snapshot slots). Only after
        reset_engine (nobody holds blocks). Waiting requests that no longer fit are aborted and
        returned."""
        slots = self.state_slots
        now = (slots.num_slots, slots.snapshots.num_slots, self.block_size)
        same_slots = (num_state_slots, num_snapshot_slots, block_size) == now
        geometry = (self.block_manager.num_blocks, self.block_size)
        if same_slots and (num_blocks, block_size) == geometry:
            return []
        assert not self.running, "resize with running requests"
        if not same_slots:  # the prefix cache may turn on or off with them
            self.state_slots = StateSlots(num_state_slots, num_snapshot_slots, block_size)
        self.block_size = block_size
        offload = self.block_manager.offload
        self.block_manager = self._new_block_manager(
            num_blocks, block_size, self.block_manager.sliding_window, offload
        )
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

    def _new_block_manager(
        self,
        num_blocks: int,
        block_size: int,
        sliding_window: int | None,
        offload: KVOffload | None,
    ) -> BlockManager:
        """A block manager with the prefix cache as enable_prefix_caching says; a block
        leaving its prefix cache takes its state snapshot along (state_slots.py)."""
        bm = BlockManager(
            num_blocks, block_size, self.enable_prefix_caching, sliding_window, offload
        )
        bm.on_forget = self.state_slots.snapshots.forget
        return bm

    def idle_timeout_s(self) -> float | None:
        """How long the service may sleep with nothing to plan before planning again (None:
        until a request arrives or ends)."""
        return self.policy.idle_timeout_s()

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
            self.handoffs.fail("deadline", deadline_only=True)
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
        demand = [r.lora_key for r in self.running if self.slots.runs_now(r)]
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
                and self.slots.runs_now(request)
                and self.loras.admit(request.lora_key, running=True)
            ):
                i += 1
                continue
            num_new = self._chunk(request, request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            request.spec.num_lookahead_tokens = self._lookahead(request, num_new, budget)
            while not self._allocate_running(request, num_new):
                if self.swaps.release_pins():
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
        if self.speculation.num_speculative_tokens == 0 or self.policy.is_padding(request):
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
        if self.handoffs.stops_at_first_token(request):
            return False
        if len(request.token_ids) + num_pending >= self.max_model_len:
            return False
        return (
            self.policy.is_padding(request)
            or request.num_output_tokens + num_pending < request.max_tokens
        )

    # -- admission order ------------------------------------------------------------------------

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        """Admit waiting requests in the policy's order (`policy.next_waiting`) while budget, seats,
        blocks and pipeline room last; stop at the first that cannot be admitted (or that was
        preempted while planning this step). A policy that lets a waiting request displace
        running ones (`policy.room_candidates`) preempts for its seat and blocks first."""
        if not self.policy.admission_open():
            return
        room = self.slots.room()
        while self.waiting and budget > 0:
            request = self.policy.next_waiting()
            if room == 0 or not self.policy.may_admit(request) or self.slots.in_flight(request):
                break
            if any(r is request for r in self.preempted):
                break
            if not self.loras.admit(request.lora_key, running=False):
                break  # its adapter has no slot this step: it leads the line next step
            while (
                len(self.running) >= self.config.max_num_seqs or not self.state_slots.can_allocate()
            ):
                freed = self._make_room(request, scheduled)
                if freed is None:
                    return
                budget += freed
            cached = self.block_manager.find_cached_blocks(request)
            cached, request.state_restore_from = self.state_slots.snapshots.cap_hit(request, cached)
            if self.swaps.start_swap_in(request, cached):
                break  # it waits for its blocks to come back; the next plan admits it
            num_cached = len(cached) * self.block_size
            num_new = self._chunk(request, num_cached, budget)
            while not self.block_manager.allocate_slots(request, num_new, cached):
                short = self.block_manager.num_blocks_short(request, num_new, cached)
                freed = self._make_room(request, scheduled, short)
                if freed is None:
                    return
                budget += freed
                num_new = self._chunk(request, num_cached, budget)
            self._remove_waiting(request)
            self._admit(request, num_cached)
            scheduled.append((request, num_new))
            self._charge(request, num_new)
            budget -= num_new
            room -= 1

    def _chunk(self, request: Request, num_computed: int, budget: int) -> int:
        """Tokens request computes now, past num_computed: the rest, up to budget, ending at a
        state snapshot's boundary for a model that keeps them (state_slots.py's `align`)."""
        num_new = min(request.num_tokens - num_computed, budget)
        return self.state_slots.snapshots.align(request, num_computed, num_new)

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
        self.state_slots.allocate(request)
        self.swaps.end_swap_in(request)
        request.pipeline.slot = self.slots.slot
        request.preemption.admitted_step_id = self.next_step_id
        c = self.counters
        if request.num_cached_tokens is None:  # first admission
            request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            c.num_prompt_tokens += request.num_prompt_tokens
        c.num_prefix_cache_query_tokens += request.num_tokens
        c.num_prefix_cache_hit_tokens += num_cached
        self.running.append(request)
        self.policy.on_admit(request)

    def _make_plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        """The plan for `scheduled` (request, tokens now), with the ids to drop and the
        requests preempted since the last plan (see plan.make_plan)."""
        plan = make_plan(self.next_step_id, self.finished_seq_ids, self.preempted, scheduled)
        self.state_slots.snapshots.take(plan)
        plan.lora_loads = self.loras.take_loads()
        for row in plan.rows:
            row.lora_slot = self.loras.slot_of(row.request.lora_key)
        if self.block_manager.offload is not None:
            plan.kv_copies = self.block_manager.offload.take_copies()
        plan.grammar_compiles = self.grammar_wait.take_unsent()
        plan.asks_grammars = self.grammar_wait.awaiting_engine
        for name, value in self.handoffs.take_plan_parts().items():  # none colocated
            setattr(plan, name, value)
        self.next_step_id += 1
        self.finished_seq_ids, self.preempted = [], []
        return plan

    def check_integrity(self) -> None:
        """Assert the block manager's and the state slots' invariants and the pipeline slots':
        each running request holds a slot in [0, P), no waiting one does, and with P > 1 none
        has two tokens pending."""
        self.block_manager.check_integrity(list(self.requests.values()))
        self.state_slots.check_integrity(
            list(self.requests.values()), self.block_manager.hash_to_block
        )
        num_slots = self.pipeline_parallel_size
        for r in self.running:
            assert r.pipeline.slot is not None and 0 <= r.pipeline.slot < num_slots, (
                f"{r.request_id}: pipeline_slot={r.pipeline.slot} with {num_slots} slots"
            )
            assert num_slots == 1 or r.num_pending_tokens <= 1, f"{r.request_id}: 2 pending"
        for r in self.waiting:
            assert r.pipeline.slot is None, f"waiting {r.request_id} holds a pipeline slot"

    # -- step results ---------------------------------------------------------------------------

    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: TopLogprobColumns | None = None,
        num_sampled_tokens: list[int] | None = None,
        num_draft_tokens: list[int] | None = None,
    ) -> list[StepOutcome]:
        """Apply a step's result; results come in plan order, one token per row, or
        num_sampled_tokens[i] for row i when given (speculative decoding: the proposals it
        accepted, then the token sampled after them); logprobs and top_logprobs per token (NaN
        where a request did not ask); num_draft_tokens: per row, the tokens the engine proposed.

        One token rule: a row that completed its request's tokens when planned (`samples`)
        turns the request's oldest pending token into its first token and appends the others;
        the accepted proposals count as computed, the rejected ones' slots are given back (see
        `_accept`). A mid-prefill row's token is discarded. Rows of requests that ended
        (finished, aborted) or were preempted since the plan are skipped: with overlap, a
        request that finished at step N may be in step N+1 too, and that token is dropped. A
        request that stops at one of its tokens drops the ones after it. Finished requests free
        their blocks."""
        rows = plan.rows
        counts = num_sampled_tokens or [1] * len(rows)
        assert len(counts) == len(rows) and sum(counts) == len(sampled_token_ids), (
            f"step {plan.step_id}: {len(sampled_token_ids)} tokens for {len(rows)} requests"
            + (f" (num_sampled_tokens={counts})" if num_sampled_tokens else "")
        )
        self.last_result_step_id = max(self.last_result_step_id, plan.step_id)
        top_rows = top_logprobs.rows() if top_logprobs is not None else None
        outcomes: list[StepOutcome] = []
        start = 0
        for i, row in enumerate(rows):
            tokens = range(start, start + counts[i])
            start += counts[i]
            if not row.samples or not self._awaits(row):
                continue
            request = row.request
            assert all(sampled_token_ids[t] >= 0 for t in tokens), (
                f"step {plan.step_id}: no token for {request.request_id}"
            )
            if num_draft_tokens:
                self._accept(row, num_draft_tokens[i], len(tokens) - 1)
            request.num_pending_tokens -= 1  # its oldest pending token is the first one
            for t in tokens:
                outcome = self._take_token(request, sampled_token_ids[t])
                if outcome is None:
                    continue
                if logprobs and not math.isnan(logprobs[t]):
                    outcome.logprob = logprobs[t]
                if top_rows is not None:
                    outcome.top_token_ids, outcome.top_logprobs = top_rows[t]
                outcomes.append(outcome)
                if outcome.finished is not None:
                    break
            if request.status == RequestStatus.RUNNING and isinstance(row, RunningRow):
                self._give_back_lookahead(row)
        self._count_generated(outcomes)
        self._after_update(plan)
        return outcomes

    def _take_token(self, request: Request, token_id: int) -> StepOutcome | None:
        """Append token_id, request's oldest pending token now known, to its tokens: its
        outcome, or None when nothing is to be streamed (`_on_token`)."""
        request.token_ids.append(token_id)
        outcome = self._on_token(request, token_id)
        if outcome is not None and outcome.finished is None and self.handoffs.hands_off(request):
            self.handoffs.hand_off(request)  # its first token is streamed from here, once
        return outcome

    def _count_generated(self, outcomes: list[StepOutcome]) -> None:
        """Count outcomes' tokens as generated, in total and for their tenants."""
        self.counters.num_generated_tokens += len(outcomes)
        for outcome in outcomes:
            self.tenants.count_generated(outcome.request.tenant)

    def _accept(self, row: NewRequestRow | RunningRow, num_draft: int, num_accepted: int) -> None:
        """row's request accepted num_accepted of num_draft proposed tokens: they were computed
        in the step (their KV is in the lookahead slots), the rejected ones were not.

            slots:  |<- computed ->|<- lookahead slots ------------>|
            after:  |<- computed ---------------->|<- given back ->|
                                   |<- accepted ->|
        """
        assert num_accepted <= num_draft <= getattr(row, "num_lookahead_tokens", 0), (
            f"{row.request.request_id}: {num_accepted} accepted of {num_draft} proposed"
        )
        row.request.num_computed_tokens += num_accepted
        self.counters.spec.add(num_draft, num_accepted)
        self.speculation.on_result(row.request, num_draft, num_accepted)

    def _give_back_lookahead(self, row: RunningRow) -> None:
        """After a row with lookahead slots: free the blocks its request's tokens do not need
        (the engine's mirror drops the same ones)."""
        if row.num_lookahead_tokens:
            request = row.request
            self.block_manager.trim(request, len(request.token_ids))
            request.mirror.num_sent_blocks = len(request.block_table)

    def _on_token(self, request: Request, token_id: int) -> StepOutcome | None:
        """request's oldest pending token turned out to be token_id, now its last: its outcome
        (None when nothing is to be streamed: a padding row's)."""
        if self.policy.drops_token(request):
            return None
        finished = self._check_stop(request, token_id)
        if finished is not None:
            self._on_stopped(request, finished)
        return StepOutcome(request, token_id, None, finished)

    def _after_update(self, plan: StepPlan) -> None:
        # plan's snapshots (taken by mid-prefill rows, which finish nothing here) are hits now
        self.state_slots.snapshots.settle(plan, self.block_manager.hash_to_block.__contains__)
        self.policy.after_update()
        if not self.requests:
            self.block_manager.check_integrity([])
            self.state_slots.check_integrity([])

    @staticmethod
    def _awaits(row: NewRequestRow | RunningRow) -> bool:
        """Whether row's request still waits for this row's token: it runs, in the same life
        (not preempted since), with a pending token."""
        request = row.request
        if request.status != RequestStatus.RUNNING:
            return False
        if request.num_preemptions != row.num_preemptions:
            return False
        assert request.num_pending_tokens > 0, f"{request.request_id}: a token nobody awaits"
        return True

    def _on_stopped(self, request: Request, status: RequestStatus) -> None:
        """request finished with status: free it (unless its policy keeps its row). Its outcome
        reports it finished."""
        if self.policy.keeps_running(request, status):
            return
        self.running.remove(request)
        self.finish(request, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if request.grammar_dead_end:  # ignore_eos or not: the constraint allows nothing more
            return RequestStatus.FINISHED_GRAMMAR_DEAD_END
        if token_id in self.eos_token_ids and not request.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    # -- preemption -----------------------------------------------------------------------------

    def preempt(self, request: Request, reason: str) -> None:
        """Free request's blocks and queue it first in line (its policy may rank it elsewhere);
        it is recomputed from all its tokens (prompt and output so far) when readmitted. Nothing
        it already produced is lost. The caller has taken it out of `running`; reason is
        counted. Swap preemption copies its blocks down to the host tier first."""
        self.swaps.swap_out(request)
        self.block_manager.free(request)
        self.state_slots.free(request)  # recomputed from its tokens: the state is rebuilt
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a token in flight is dropped, sampled again on recompute
        request.spec.num_lookahead_tokens = 0
        request.num_preemptions += 1
        request.preemption.reason = reason
        request.pipeline.slot = None  # readmission gives it one again
        self.drop_from_engine(request)
        self.waiting.appendleft(request)
        self.counters.num_preemptions += 1
        by_reason = self.counters.num_preemptions_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self.preempted.append(request)

    def _evict(self, i: int, scheduled: list[tuple[Request, int]]) -> tuple[Request, int]:
        """Free blocks for running[i]: end a row the policy gives up (padding), else preempt
        the policy's victim (`memory_victim`), taking it out of scheduled if this step
        scheduled it. Returns (the victim, the budget it gave back: > 0 exactly when it was in
        scheduled)."""
        freed_row = self.policy.free_row(i)
        if freed_row is not None:
            return freed_row, 0
        victim = self.policy.memory_victim(self.running[i])
        freed = self._unschedule(victim, scheduled)
        self.running.remove(victim)
        self.preempt(victim, "memory")
        return victim, freed

    def _unschedule(self, request: Request, scheduled: list[tuple[Request, int]]) -> int:
        """Take request out of scheduled (this step's rows so far); returns the budget it held
        (0 when it was not there). Its blocks are the caller's to free."""
        for k, (r, num_new) in enumerate(scheduled):
            if r is request:
                del scheduled[k]
                return num_new + r.spec.num_lookahead_tokens
        return 0

    def _make_room(
        self,
        request: Request,
        scheduled: list[tuple[Request, int]],
        num_blocks_short: int = 0,
    ) -> int | None:
        """Preempt one running request for waiting request: the first unprotected of its
        policy's `room_candidates` (reason `room_reason`). Returns the budget the victim gave
        back (0 if it was not scheduled this step), or None when there is no victim (a refusal
        is counted when candidates were all protected). With num_blocks_short > 0 (blocks, not
        a seat), nobody is preempted unless the unprotected candidates hold that many blocks of
        their own: preempting them all would not admit request, only waste their work."""
        ranked = self.policy.room_candidates(request)
        candidates = [r for r in ranked if not self.policy.is_protected(r)]
        if not candidates:
            self.counters.num_preemptions_refused += bool(ranked)
            return None
        if num_blocks_short and self.block_manager.num_owned_blocks(candidates) < num_blocks_short:
            return None
        victim = candidates[0]
        freed = self._unschedule(victim, scheduled)
        self.running.remove(victim)
        self.preempt(victim, self.policy.room_reason)
        return freed
