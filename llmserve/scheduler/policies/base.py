"""What a scheduling policy decides, and the fcfs policy.

A policy is an object the Scheduler holds (`scheduler.policy`) and asks by name: whom to admit
next (`next_waiting`), whom to preempt first (`victim_order`), whom a waiting request may
displace (`room_candidates`). Bounded preemption holds for every policy (`is_protected`,
`memory_victim`). The rest are the points where static batching (policies/static_batching.py)
differs; every other policy keeps their defaults. What preempting does is the Scheduler's
(scheduler/scheduler.py, `preempt`).
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from llmserve.scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from llmserve.scheduler.scheduler import Scheduler


class Policy(abc.ABC):
    """The order of a scheduler's queue and its victims. `bind` gives it its scheduler."""

    # The preemption reason a waiting request that displaces a running one counts.
    room_reason = "policy"

    def bind(self, scheduler: Scheduler) -> None:
        self.s = scheduler

    @abc.abstractmethod
    def next_waiting(self) -> Request:
        """The waiting request to admit next (someone waits)."""

    @abc.abstractmethod
    def victim_order(self) -> list[Request]:
        """Running requests, the first to preempt first."""

    def room_candidates(self, request: Request) -> list[Request]:
        """Whom waiting request, short of a seat or blocks, may preempt, the first to go first
        (protection aside). Default: nobody (a waiting request never displaces a running one)."""
        return []

    # -- bounded preemption, every policy ------------------------------------------------------

    def is_protected(self, request: Request) -> bool:
        """Whether running request may not be chosen as a victim: it was preempted
        max_preemptions times, or admitted fewer than preemption_grace_steps steps ago."""
        config = self.s.config
        if config.max_preemptions and request.num_preemptions >= config.max_preemptions:
            return True
        grace = config.preemption_grace_steps
        return self.s.next_step_id - request.preemption.admitted_step_id < grace

    def memory_victim(self, request: Request) -> Request:
        """Whom running request, short of a block, preempts: the first in `victim_order` that
        is not protected, or request itself if it comes first. A request never takes blocks
        from one ranked above it, and the walk always ends: when everyone ranked below it is
        protected, it gives its own blocks back (a self-preemption is the request's own
        choice, so protection does not stop it). Skipping a protected one counts a refusal."""
        refused = False
        for victim in self.victim_order():
            if victim is request or not self.is_protected(victim):
                self.s.counters.num_preemptions_refused += refused
                return victim
            refused = True
        raise AssertionError(f"{request.request_id} is not running")

    # -- where static batching differs (defaults: continuous batching) -------------------------

    def admission_open(self) -> bool:
        """Whether this step admits waiting requests at all (static: a batch is formed)."""
        return True

    def may_admit(self, request: Request) -> bool:
        """Whether waiting request (next in line) may be admitted this step."""
        return True

    def on_admit(self, request: Request) -> None:
        """request was admitted."""
        return None

    def keeps_running(self, request: Request, status: RequestStatus) -> bool:
        """Whether request, finished with status, keeps its row (static: as padding)."""
        return False

    def is_padding(self, request: Request) -> bool:
        """Whether running request runs on without streaming (static's padding rows)."""
        return False

    def drops_token(self, request: Request) -> bool:
        """Whether request's token just appended is thrown away, not streamed (padding)."""
        return False

    def free_row(self, i: int) -> Request | None:
        """A row to end for running[i]'s blocks instead of a preemption (padding), or None."""
        return None

    def after_update(self) -> None:
        """A step's result was applied."""
        return None

    def on_abort(self, seq_id: int) -> None:
        """seq_id is being aborted."""
        return None

    def after_abort(self) -> None:
        """A request was aborted."""
        return None

    def on_reset(self) -> None:
        """The engine lost its pool; running requests are about to be preempted."""
        return None

    def idle_timeout_s(self) -> float | None:
        """How long the service may sleep with nothing to plan (None: until a request arrives
        or ends)."""
        return None

    def check_engine(self, pipeline_parallel_size: int, num_speculative_tokens: int) -> None:
        """Raise ValueError when this policy cannot plan for such an engine."""
        return None


class FcfsPolicy(Policy):
    """Arrival order; the newest running request is preempted first."""

    def next_waiting(self) -> Request:
        return self.s.waiting[0]

    def victim_order(self) -> list[Request]:
        return self.s.running[::-1]
