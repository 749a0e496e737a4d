"""Static batching, the baseline continuous batching is measured against (`--scheduling-policy
static`): a batch is formed only when nothing runs, from the first waiting requests whose blocks
fit at once with each padded to the batch's longest output; nothing else is admitted until its
last member finishes. Padding is real work, as in HF transformers' `generate`: a finished
member keeps its slot, blocks and row, decoding throwaway tokens, until the batch ends (a padding
row stops early only at max_model_len, or when a real member needs its block: padding never
preempts). Pipeline parallelism is refused: one batch over pipeline slots would be another
baseline. See docs/scheduling.md#static-versus-continuous-batching.
"""

from __future__ import annotations

import itertools
import time

from llmserve.scheduler.policies.base import Policy
from llmserve.scheduler.request import Request, RequestStatus


class StaticBatching(Policy):
    """Batches formed when nothing runs; finished members run on as padding (module docstring).
    Arrival order and preemption as fcfs."""

    def next_waiting(self) -> Request:
        return self.s.waiting[0]

    def victim_order(self) -> list[Request]:
        return self.s.running[::-1]

    def __init__(self) -> None:
        # Members of the current batch not yet admitted, and members that finished but still
        # run as padding (seq_id -> how they finished).
        self.batch_pending: set[int] = set()
        self.padding: dict[int, RequestStatus] = {}

    def idle_timeout_s(self) -> float | None:
        """Seconds until the forming batch starts even if not full (0: start now); None when no
        batch is forming (a batch running, nobody waiting, or enough waiting to fill one)."""
        s = self.s
        if s.running or not s.waiting or len(s.waiting) >= s.config.max_num_seqs:
            return None
        deadline = s.waiting[0].arrival_time + s.config.static_batch_wait_ms / 1e3
        return max(0.0, deadline - time.monotonic())

    def check_engine(self, pipeline_parallel_size: int, num_speculative_tokens: int) -> None:
        """Raises ValueError for more than one pipeline stage (see the module's docstring) or
        speculative decoding (the baseline decodes one token a step)."""
        if pipeline_parallel_size > 1:
            raise ValueError(
                f"scheduling_policy='static' does not support pipeline parallelism (the "
                f"engine's pipeline_parallel_size={pipeline_parallel_size}); use "
                f"--scheduling-policy fcfs, or an engine of one pipeline stage"
            )
        if num_speculative_tokens:
            raise ValueError(
                f"scheduling_policy='static' does not support speculative decoding (the "
                f"engine's num_speculative_tokens={num_speculative_tokens}); use "
                f"--scheduling-policy fcfs, or an engine without --speculative-method"
            )

    def admission_open(self) -> bool:
        if not self.s.running:
            if self.idle_timeout_s():
                return False  # the batch is still forming
            self.batch_pending = self._next_batch()
        return True

    def may_admit(self, request: Request) -> bool:
        return request.seq_id in self.batch_pending

    def on_admit(self, request: Request) -> None:
        self.batch_pending.discard(request.seq_id)

    def keeps_running(self, request: Request, status: RequestStatus) -> bool:
        """Finished becomes padding until the batch drains (at max_model_len there is no room
        to pad: it ends now)."""
        if len(request.token_ids) < self.s.max_model_len:
            self.padding[request.seq_id] = status
            return True
        return False

    def is_padding(self, request: Request) -> bool:
        return request.seq_id in self.padding

    def drops_token(self, request: Request) -> bool:
        """A padding row's token is thrown away; the row ends at max_model_len."""
        if request.seq_id not in self.padding:
            return False
        if len(request.token_ids) >= self.s.max_model_len:
            self._end_padding(request)
        return True

    def free_row(self, i: int) -> Request | None:
        """End the newest padding row not yet scheduled this step (index >= i)."""
        running = self.s.running
        victim = next((r for r in reversed(running[i:]) if r.seq_id in self.padding), None)
        if victim is not None:
            self._end_padding(victim)
        return victim

    def after_update(self) -> None:
        self._end_drained_batch()

    def on_abort(self, seq_id: int) -> None:
        """An aborted member leaves the batch (a batch left with padding only then ends)."""
        self.padding.pop(seq_id, None)

    def after_abort(self) -> None:
        self._end_drained_batch()

    def on_reset(self) -> None:
        """Padding rows are freed, not preempted: they have nothing left to do."""
        for request in [r for r in self.s.running if r.seq_id in self.padding]:
            self._end_padding(request)

    # -- batches ----------------------------------------------------------------------------------

    def _next_batch(self) -> set[int]:
        """The seq ids of the next batch: the first waiting requests (at most max_num_seqs) whose
        blocks all fit in the free pool when each is padded to its prompt + the batch's largest
        max_tokens (within max_model_len). The first always fits: nothing runs, and
        check_admissible made sure it fits the pool alone."""
        s = self.s
        members: list[Request] = []
        max_new = 0
        for request in itertools.islice(s.waiting, s.config.max_num_seqs):
            max_new = max(max_new, request.max_tokens)
            padded = [min(r.num_prompt_tokens + max_new, s.max_model_len) for r in members]
            padded.append(min(request.num_prompt_tokens + max_new, s.max_model_len))
            need = sum(s.block_manager.num_blocks_for(n) for n in padded)
            if members and need > s.block_manager.num_free_blocks:
                break
            members.append(request)
        return {r.seq_id for r in members}

    def _end_padding(self, request: Request) -> None:
        """Free a padding row with the status it finished with."""
        self.s.running.remove(request)
        self.s.finish(request, self.padding.pop(request.seq_id))

    def _end_drained_batch(self) -> None:
        """Once every running request is padding, the batch is over."""
        if self.padding and all(r.seq_id in self.padding for r in self.s.running):
            for request in list(self.s.running):
                self._end_padding(request)
