"""Iteration-level scheduling: each call to `schedule` plans one engine step.

Every running request catches its `num_computed_tokens` up to `num_tokens` a chunk at a time, so
prefill, chunked prefill, decode and prefix-cache hits are one mechanism: a step gives each request
some tokens out of the token budget. Running requests go first (oldest first); waiting requests are
admitted with what budget and blocks are left. When blocks run out, the newest running request is
preempted: its blocks are freed and it waits again, to be recomputed from its tokens later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.request import Request, RequestStatus


class AdmissionError(Exception):
    """A request refused at admission. `code` is a gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class NewRequestRow:
    request: Request
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass
class RunningRow:
    request: Request
    num_scheduled_tokens: int
    num_computed_tokens: int
    new_block_ids: list[int]


@dataclass
class StepPlan:
    """One step for the engine. Batch order: new_requests, then running."""

    step_id: int
    finished_seq_ids: list[int]
    new_requests: list[NewRequestRow]
    running: list[RunningRow]

    @property
    def requests(self) -> list[Request]:
        return [r.request for r in self.new_requests] + [r.request for r in self.running]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.new_requests) + sum(
            r.num_scheduled_tokens for r in self.running
        )

    @property
    def is_empty(self) -> bool:
        return not (self.new_requests or self.running or self.finished_seq_ids)


@dataclass
class StepOutcome:
    """What a step produced for one request: its new token (if any) and whether it finished."""

    request: Request
    token_id: int
    logprob: float | None
    finished: RequestStatus | None


@dataclass
class SchedulerCounters:
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    num_finished_requests: int = 0
    num_prefix_cache_hit_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ):
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        # Requests the engine mirrors that it must drop before the next plan.
        self.finished_seq_ids: list[int] = []
        self.next_step_id = 1
        self.counters = SchedulerCounters()

    # -- admission ------------------------------------------------------------------------------

    def check_admissible(self, request: Request) -> None:
        """Raise AdmissionError if request can never run or the queue is full. Changes nothing."""
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise AdmissionError("INVALID_ARGUMENT", "prompt_token_ids is empty")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt_token_ids contains {bad[0]}, "
                f"outside the vocabulary [0, {self.vocab_size})",
            )
        if request.max_tokens < 1:
            raise AdmissionError(
                "INVALID_ARGUMENT", f"max_tokens={request.max_tokens} must be >= 1"
            )
        total = num_prompt + request.max_tokens
        if total > self.max_model_len:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds max_model_len={self.max_model_len}",
            )
        capacity = self.block_manager.num_blocks * self.block_size
        if total > capacity:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds the KV cache's capacity of {capacity} tokens "
                f"({self.block_manager.num_blocks} blocks x {self.block_size})",
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise AdmissionError(
                "RESOURCE_EXHAUSTED",
                f"queue full: {len(self.waiting)} requests waiting (max_waiting="
                f"{self.config.max_waiting}); retry after a short delay",
            )

    def add(self, request: Request) -> None:
        """Queue request (after check_admissible). It runs from a later `schedule`."""
        self.check_admissible(request)
        assert request.seq_id not in self.requests, f"seq_id {request.seq_id} reused"
        request.arrival_time = request.arrival_time or time.monotonic()
        self.requests[request.seq_id] = request
        self.waiting.append(request)

    def abort(self, seq_id: int) -> Request | None:
        """End a request wherever it is; its blocks are free on return. Unknown ids are ignored."""
        request = self.requests.get(seq_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        request.status = status
        self.block_manager.free(request)
        del self.requests[request.seq_id]
        if request.in_engine:
            self.finished_seq_ids.append(request.seq_id)
            request.in_engine = False
        self.counters.num_finished_requests += 1
        reasons = self.counters.finish_reasons
        reasons[status.value] = reasons.get(status.value, 0) + 1

    def _preempt(self, request: Request) -> None:
        """Free request's blocks and queue it first in line; it is recomputed from all its tokens
        (prompt and output so far) when readmitted. Nothing it already produced is lost."""
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.in_engine:
            self.finished_seq_ids.append(request.seq_id)
            request.in_engine = False
        self.waiting.appendleft(request)
        self.counters.num_preemptions += 1

    def reset_engine(self) -> None:
        """The engine lost its mirror and KV pool (it restarted, or failed a step): preempt every
        running request and forget the prefix cache, so all work is redone from tokens."""
        for request in reversed(self.running):
            self._preempt(request)
        self.running = []
        self.finished_seq_ids = []
        for request in self.waiting:
            request.in_engine = False
        self.block_manager.reset_prefix_cache()
        self.block_manager.check_integrity(list(self.requests.values()))

    def resize(self, num_blocks: int, block_size: int) -> list[Request]:
        """Adopt a restarted engine's pool geometry. Only after reset_engine (nobody holds blocks).
        Waiting requests that no longer fit are aborted and returned."""
        if (num_blocks, block_size) == (self.block_manager.num_blocks, self.block_size):
            return []
        assert not self.running, "resize with running requests"
        self.block_size = block_size
        self.block_manager = BlockManager(num_blocks, block_size, self.config.enable_prefix_caching)
        for request in self.waiting:
            request.block_hashes = []  # hashed per block, so they depend on block_size
        capacity = num_blocks * block_size
        too_big = [r for r in self.waiting if r.num_prompt_tokens + r.max_tokens > capacity]
        for request in too_big:
            self.abort(request.seq_id)
        return too_big

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.finished_seq_ids)

    # -- planning -------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan one step: choose requests and their token counts, allocate their blocks, preempt
        if needed. Advances each scheduled request's num_computed_tokens (the step is assumed to
        run); the plan lists what the engine needs to know."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        budget, preempted = self._schedule_running(budget, scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        plan = self._make_plan(scheduled)
        self.counters.num_steps += 1
        self.counters.num_scheduled_tokens += plan.num_scheduled_tokens
        return plan

    def _schedule_running(
        self, budget: int, scheduled: list[tuple[Request, int]]
    ) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1
        return budget, preempted

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached = self.block_manager.find_cached_blocks(request)
            num_cached = len(cached) * self.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
            self.counters.num_prefix_cache_hit_tokens += num_cached
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

    def _make_plan(self, scheduled: list[tuple[Request, int]]) -> StepPlan:
        plan = StepPlan(self.next_step_id, self.finished_seq_ids, [], [])
        self.next_step_id += 1
        self.finished_seq_ids = []
        for request, num_new in scheduled:
            if not request.in_engine:
                plan.new_requests.append(
                    NewRequestRow(
                        request,
                        list(request.token_ids),
                        list(request.block_table),
                        request.num_computed_tokens,
                        num_new,
                    )
                )
                request.in_engine = True
            else:
                plan.running.append(
                    RunningRow(
                        request,
                        num_new,
                        request.num_computed_tokens,
                        request.block_table[request.num_sent_blocks :],
                    )
                )
            request.num_sent_blocks = len(request.block_table)
            request.num_computed_tokens += num_new
        return plan

    # -- results --------------------------------------------------------------------------------

    def update(
        self, plan: StepPlan, sampled_token_ids: list[int], logprobs: list[float] | None
    ) -> list[StepOutcome]:
        """Apply a step's result. One token rule: a request whose computed tokens reached its full
        length appends the sampled token; a mid-prefill request's token is discarded. Requests
        aborted while the step ran are skipped. Finished requests free their blocks."""
        requests = plan.requests
        assert len(sampled_token_ids) == len(requests), (
            f"step {plan.step_id}: {len(sampled_token_ids)} tokens for {len(requests)} requests"
        )
        outcomes = []
        for i, request in enumerate(requests):
            if (
                request.status != RequestStatus.RUNNING
                or request.num_computed_tokens < request.num_tokens
            ):
                continue
            token_id = sampled_token_ids[i]
            assert token_id >= 0, f"step {plan.step_id}: no token for {request.request_id}"
            request.token_ids.append(token_id)
            finished = self._check_stop(request, token_id)
            if finished is not None:
                self.running.remove(request)
                self._finish(request, finished)
            logprob = logprobs[i] if logprobs else None
            outcomes.append(StepOutcome(request, token_id, logprob, finished))
        if not self.requests:
            self.block_manager.check_integrity([])
        return outcomes

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if token_id in self.eos_token_ids and not request.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
