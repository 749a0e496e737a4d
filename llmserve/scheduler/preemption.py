"""Preemption: whom a request short of a block or a seat displaces, and what preempting does.

Preemption is recompute: the victim's blocks are freed and it waits again, first in line, to be
recomputed from its tokens. With --preemption-mode swap (and a host tier) its full blocks are
copied down to the host tier first, and its readmission brings them back
(scheduler/swaps.py). Whom it picks is the policy's (hooks `_victim_order`,
`_room_candidates`); bounded preemption (`_is_protected`) holds for every policy.
"""

from __future__ import annotations

from llmserve.scheduler.swaps import Offloading
from llmserve.scheduler.request import Request, RequestStatus


class Preemption(Offloading):
    def _preempt(self, request: Request, reason: str) -> None:
        """Free request's blocks and queue it first in line (its policy may rank it elsewhere);
        it is recomputed from all its tokens (prompt and output so far) when readmitted. Nothing
        it already produced is lost. The caller has taken it out of `running`; reason is
        counted. Swap preemption copies its blocks down to the host tier first."""
        self._swap_out(request)
        self.block_manager.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a token in flight is dropped, sampled again on recompute
        request.spec.num_lookahead_tokens = 0
        request.num_preemptions += 1
        request.preemption.reason = reason
        request.pipeline.slot = None  # readmission gives it one again
        self._drop_from_engine(request)
        self.waiting.appendleft(request)
        self.counters.num_preemptions += 1
        by_reason = self.counters.num_preemptions_by_reason
        by_reason[reason] = by_reason.get(reason, 0) + 1
        self.preempted.append(request)

    def _evict(self, i: int, scheduled: list[tuple[Request, int]]) -> tuple[Request, int]:
        """Free blocks for running[i] (hook): preempt the policy's victim (`_memory_victim`),
        taking it out of scheduled if this step scheduled it. Returns (the victim, the budget
        it gave back: > 0 exactly when it was in scheduled)."""
        victim = self._memory_victim(self.running[i])
        freed = self._unschedule(victim, scheduled)
        self.running.remove(victim)
        self._preempt(victim, "memory")
        return victim, freed

    def _unschedule(self, request: Request, scheduled: list[tuple[Request, int]]) -> int:
        """Take request out of scheduled (this step's rows so far); returns the budget it held
        (0 when it was not there). Its blocks are the caller's to free."""
        for k, (r, num_new) in enumerate(scheduled):
            if r is request:
                del scheduled[k]
                return num_new + r.spec.num_lookahead_tokens
        return 0

    def _victim_order(self) -> list[Request]:
        """Running requests, the first to preempt first (hook). fcfs: the newest first."""
        return self.running[::-1]

    def _is_protected(self, request: Request) -> bool:
        """Whether running request may not be chosen as a victim: it was preempted
        max_preemptions times, or admitted fewer than preemption_grace_steps steps ago."""
        config = self.config
        if config.max_preemptions and request.num_preemptions >= config.max_preemptions:
            return True
        return (
            self.next_step_id - request.preemption.admitted_step_id < config.preemption_grace_steps
        )

    def _memory_victim(self, request: Request) -> Request:
        """Whom running request, short of a block, preempts: the first in `_victim_order` that
        is not protected, or request itself if it comes first. A request never takes blocks
        from one ranked above it, and the walk always ends: when everyone ranked below it is
        protected, it gives its own blocks back (a self-preemption is the request's own
        choice, so protection does not stop it). Skipping a protected one counts a refusal."""
        refused = False
        for victim in self._victim_order():
            if victim is request or not self._is_protected(victim):
                self.counters.num_preemptions_refused += refused
                return victim
            refused = True
        raise AssertionError(f"{request.request_id} is not running")

    def _room_candidates(self, request: Request) -> list[Request]:
        """Whom waiting request, short of a seat or blocks, may preempt, the first to go first
        (hook; protection aside). fcfs: nobody (a waiting request never displaces a running
        one)."""
        return []

    def _make_room(
        self,
        request: Request,
        scheduled: list[tuple[Request, int]],
        num_blocks_short: int = 0,
    ) -> int | None:
        """Preempt one running request for waiting request: the first unprotected of its
        `_room_candidates` (reason `room_reason`). Returns the budget the victim gave back (0 if
        it was not scheduled this step), or None when there is no victim (a refusal is counted
        when candidates were all protected). With num_blocks_short > 0 (blocks, not a seat),
        nobody is preempted unless the unprotected candidates hold that many blocks of their
        own: preempting them all would not admit request, only waste their work."""
        ranked = self._room_candidates(request)
        candidates = [r for r in ranked if not self._is_protected(r)]
        if not candidates:
            self.counters.num_preemptions_refused += bool(ranked)
            return None
        if num_blocks_short and self.block_manager.num_owned_blocks(candidates) < num_blocks_short:
            return None
        victim = candidates[0]
        freed = self._unschedule(victim, scheduled)
        self.running.remove(victim)
        self._preempt(victim, self.room_reason)
        return freed

    room_reason = "policy"
