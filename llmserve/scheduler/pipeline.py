"""Pipeline slots: which running requests a step of a P-stage engine may hold.

An engine of P > 1 stages can run P steps at once, one per stage, provided no request is in two of
them (a request's next token comes out of the last stage). Each running request holds a pipeline
slot in [0, P): step s serves slot s % P only, and a request with a step in flight is not scheduled
again until that step's result is in, so no placeholder token is ever planned on. A waiting request
joins the slot of the step that admits it; admission keeps the slots balanced (`_slot_room`). With P
== 1 every step serves every request, and overlap plans on pending tokens as described in
`Scheduler.schedule`.
"""

from __future__ import annotations

from llmserve.scheduler.request import Request
from llmserve.scheduler.state import SchedulerState


class PipelineSlots(SchedulerState):
    @property
    def slot(self) -> int:
        """The pipeline slot the step being planned serves: step s serves slot s % P."""
        return self.next_step_id % self.pipeline_parallel_size

    def _in_flight(self, request: Request) -> bool:
        """With P > 1: whether a step holding request has no result yet. Always False with
        P == 1, where steps in flight may share requests (overlap plans on pending tokens)."""
        return (
            self.pipeline_parallel_size > 1
            and request.pipeline.last_step_id > self.last_result_step_id
        )

    def _runs_now(self, request: Request) -> bool:
        """Whether running request may be in the step being planned: with P > 1 only in its
        slot's steps, and only once the result of its last step is in."""
        if self.pipeline_parallel_size == 1:
            return True
        return request.pipeline.slot == self.slot and not self._in_flight(request)

    def _slot_room(self) -> int:
        """How many waiting requests the step being planned may admit (besides the step limits).

        P == 1: no limit of its own. P > 1, the balance rule: a slot admits while it holds
        fewer than

            cap = ceil(min(running + waiting, max_num_seqs) / P)

        requests, counted as the step's admission starts (it moves requests from waiting to
        running, so the sum holds meanwhile). max_num_seqs bounds it so that a long queue does
        not let the first slot to admit take every seat. A slot at its cap leaves the queue to
        the others: while someone waits and fewer than max_num_seqs run, some other slot holds
        fewer than cap (else running >= P * cap >= running + waiting), and admits at its own
        step, at most P - 1 steps later."""
        num_slots = self.pipeline_parallel_size
        if num_slots == 1:
            return len(self.waiting)
        cap = -(-min(len(self.running) + len(self.waiting), self.config.max_num_seqs) // num_slots)
        slot = self.slot
        return max(0, cap - sum(r.pipeline.slot == slot for r in self.running))
