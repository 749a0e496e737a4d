"""Static batching, the baseline continuous batching is measured against (`--scheduling-policy
static`): a batch is formed only when nothing runs, from the first waiting requests (at most
max_num_seqs) whose blocks fit at once with each one padded to the batch's longest output (its
prompt + the largest max_tokens among them). The batch is admitted, prefills, decodes, and no
other request is admitted until its last member finishes.

Padding is real work, as in HF transformers' `generate`: a member that finishes is reported
finished to its client at once, but keeps its slot, its blocks and a row in every step, decoding
throwaway tokens that are never streamed (the engine cannot tell them from real ones), until the
last member finishes; then all are freed together. A padding row stops early only at
max_model_len, or when a block it needs is wanted by a real member (padding never causes a
preemption).

Static batching refuses pipeline parallelism (an engine of pipeline_parallel_size > 1): it is
a baseline, and one batch split over pipeline slots would be a different baseline.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.policies.fair import FairScheduler
from llmserve.scheduler.plan import StepOutcome
from llmserve.scheduler.policies.priority import PriorityScheduler
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # Members of the current batch not yet admitted, and members that finished but still
        # run as padding (seq_id -> how they finished).
        self.batch_pending: set[int] = set()
        self.padding: dict[int, RequestStatus] = {}

    def idle_timeout_s(self) -> float | None:
        """Seconds until the forming batch starts even if not full (0: start now); None when no
        batch is forming (a batch running, nobody waiting, or enough waiting to fill one)."""
        if self.running or not self.waiting or len(self.waiting) >= self.config.max_num_seqs:
            return None
        deadline = self.waiting[0].arrival_time + self.config.static_batch_wait_ms / 1e3
        return max(0.0, deadline - time.monotonic())

    def set_pipeline_parallel_size(self, pipeline_parallel_size: int) -> None:
        """Raises ValueError for more than one pipeline stage (see the module's docstring)."""
        if pipeline_parallel_size > 1:
            raise ValueError(
                f"scheduling_policy='static' does not support pipeline parallelism (the "
                f"engine's pipeline_parallel_size={pipeline_parallel_size}); use "
                f"--scheduling-policy fcfs, or an engine of one pipeline stage"
            )
        super().set_pipeline_parallel_size(pipeline_parallel_size)

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Raises ValueError for speculative decoding (the baseline decodes one token a step)."""
        if num_speculative_tokens:
            raise ValueError(
                f"scheduling_policy='static' does not support speculative decoding (the "
                f"engine's num_speculative_tokens={num_speculative_tokens}); use "
                f"--scheduling-policy fcfs, or an engine without --speculative-method"
            )
        super().set_num_speculative_tokens(num_speculative_tokens)

    # -- the hooks --------------------------------------------------------------------------------

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> None:
        if not self.running:
            if self.idle_timeout_s():
                return  # the batch is still forming
            self.batch_pending = self._next_batch()
        super()._schedule_waiting(budget, scheduled)

    def _may_admit(self, request: Request) -> bool:
        return request.seq_id in self.batch_pending

    def _admit(self, request: Request, num_cached: int) -> None:
        super()._admit(request, num_cached)
        self.batch_pending.discard(request.seq_id)

    def _on_stopped(self, request: Request, status: RequestStatus) -> None:
        """Finished becomes padding until the batch drains (at max_model_len there is no room
        to pad: it ends now)."""
        if len(request.token_ids) < self.max_model_len:
            self.padding[request.seq_id] = status
        else:
            super()._on_stopped(request, status)

    def _is_padding(self, request: Request) -> bool:
        return request.seq_id in self.padding

    def _on_token(self, request: Request, token_id: int) -> StepOutcome | None:
        """A padding row's token is thrown away; the row ends at max_model_len."""
        if request.seq_id not in self.padding:
            return super()._on_token(request, token_id)
        if len(request.token_ids) >= self.max_model_len:
            self._end_padding(request)
        return None

    def _evict(self, i: int, scheduled: list[tuple[Request, int]]) -> tuple[Request, int]:
        """End the newest padding row not yet scheduled this step (index >= i), else preempt."""
        victim = next((r for r in reversed(self.running[i:]) if r.seq_id in self.padding), None)
        if victim is None:
            return super()._evict(i, scheduled)
        self._end_padding(victim)
        return victim, 0

    def _after_update(self) -> None:
        self._end_drained_batch()
        super()._after_update()

    def abort(self, seq_id: int) -> Request | None:
        was_padding = self.padding.pop(seq_id, None) is not None
        request = super().abort(seq_id)
        if was_padding or self.padding:
            self._end_drained_batch()
        return request

    def reset_engine(self) -> list[Request]:
        """Padding rows are freed, not preempted: they have nothing left to do."""
        for request in [r for r in self.running if r.seq_id in self.padding]:
            self._end_padding(request)
        return super().reset_engine()

    # -- batches ----------------------------------------------------------------------------------

    def _next_batch(self) -> set[int]:
        """The seq ids of the next batch: the first waiting requests (at most max_num_seqs) whose
        blocks all fit in the free pool when each is padded to its prompt + the batch's largest
        max_tokens (within max_model_len). The first always fits: nothing runs, and
        check_admissible made sure it fits the pool alone."""
        members: list[Request] = []
        max_new = 0
        for request in itertools.islice(self.waiting, self.config.max_num_seqs):
            max_new = max(max_new, request.max_tokens)
            padded = [min(r.num_prompt_tokens + max_new, self.max_model_len) for r in members]
            padded.append(min(request.num_prompt_tokens + max_new, self.max_model_len))
            need = sum(self.block_manager.num_blocks_for(n) for n in padded)
            if members and need > self.block_manager.num_free_blocks:
                break
            members.append(request)
        return {r.seq_id for r in members}

    def _end_padding(self, request: Request) -> None:
        """Free a padding row with the status it finished with."""
        self.running.remove(request)
        self._finish(request, self.padding.pop(request.seq_id))

    def _end_drained_batch(self) -> None:
        """Once every running request is padding, the batch is over."""
        if self.padding and all(r.seq_id in self.padding for r in self.running):
            for request in list(self.running):
                self._end_padding(request)


def make_scheduler(
    config: SchedulerConfig,
    *args: Any,
    pipeline_parallel_size: int = 1,
    num_speculative_tokens: int = 0,
    num_host_blocks: int = 0,
    num_disk_blocks: int = 0,
    kv_block_bytes: int = 0,
) -> Scheduler:
    """The scheduler for config.scheduling_policy; args as Scheduler's after the config.
    Raises ValueError when the policy cannot use pipeline_parallel_size or speculation."""
    classes: dict[str, type[Scheduler]] = {
        "fcfs": Scheduler,
        "fair": FairScheduler,
        "priority": PriorityScheduler,
        "static": StaticBatchScheduler,
    }
    cls = classes[config.policy]
    return cls(
        config,
        *args,
        pipeline_parallel_size=pipeline_parallel_size,
        num_speculative_tokens=num_speculative_tokens,
        num_host_blocks=num_host_blocks,
        num_disk_blocks=num_disk_blocks,
        kv_block_bytes=kv_block_bytes,
    )
