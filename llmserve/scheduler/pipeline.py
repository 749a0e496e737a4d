"""Pipeline slots: which running requests a step of a P-stage engine may hold.

An engine of P > 1 stages can run P steps at once, one per stage, provided no request is in two of
them (a request's next token comes out of the last stage). Each running request holds a pipeline
slot in [0, P): step s serves slot s % P only, and a request with a step in flight is not scheduled
again until that step's result is in, so no placeholder token is ever planned on. A waiting request
joins the slot of the step that admits it; admission keeps the slots balanced (`room`). With P
== 1 every step serves every request, and overlap plans on pending tokens as described in
`Scheduler.schedule`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.scheduler.request import Request

if TYPE_CHECKING:
    from llmserve.scheduler.scheduler import Scheduler


class PipelineSlots:
    """The slots of one Scheduler's engine of `size` stages (`scheduler.slots`)."""

    def __init__(self, scheduler: Scheduler, size: int = 1):
        self.s = scheduler
        self.size = size

    @property
    def slot(self) -> int:
        """The pipeline slot the step being planned serves: step s serves slot s % P."""
        return self.s.next_step_id % self.size

    def in_flight(self, request: Request) -> bool:
        """With P > 1: whether a step holding request has no result yet. Always False with
        P == 1, where steps in flight may share requests (overlap plans on pending tokens)."""
        return self.size > 1 and request.pipeline.last_step_id > self.s.last_result_step_id

    def runs_now(self, request: Request) -> bool:
        """Whether running request may be in the step being planned: with P > 1 only in its
        slot's steps, and only once the result of its last step is in."""
        if self.size == 1:
            return True
        return request.pipeline.slot == self.slot and not self.in_flight(request)

    def room(self) -> int:
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
        num_slots = self.size
        if num_slots == 1:
            return len(self.s.waiting)
        cap = -(
            -min(len(self.s.running) + len(self.s.waiting), self.s.config.max_num_seqs) // num_slots
        )
        slot = self.slot
        return max(0, cap - sum(r.pipeline.slot == slot for r in self.s.running))
