"""The priority policy (`--scheduling-policy priority`): each request's `priority` (lower runs
first, vLLM's convention) orders the queue, ties by arrival.

- Admission: the waiting request of the lowest (priority, arrival) is admitted next; a preempted
  request keeps its arrival, so it goes before later ones of its priority.
- Preemption for priority (reason "priority"): a waiting request that finds no seat or no blocks
  preempts running requests of a strictly higher priority value, the highest value first, and of
  those the latest admitted, until it fits (protected ones are skipped: policies/base.py); and none
  at all when short of blocks that all of them together do not hold: that would only waste
  their work.
- Memory preemption (reason "memory"): the running request of the highest priority value, the
  latest admitted among them, as in the fcfs policy's "newest first" within a priority.
"""

from __future__ import annotations

from llmserve.scheduler.policies.base import Policy
from llmserve.scheduler.request import Request


class PriorityPolicy(Policy):
    room_reason = "priority"

    def next_waiting(self) -> Request:
        return min(self.s.waiting, key=lambda r: (r.priority, r.arrival_time, r.seq_id))

    def victim_order(self) -> list[Request]:
        """Running requests by priority value, highest first; within one, the latest admitted
        first (running is in admission order)."""
        order = list(enumerate(self.s.running))
        order.sort(key=lambda ir: (ir[1].priority, ir[0]), reverse=True)
        return [r for _, r in order]

    def room_candidates(self, request: Request) -> list[Request]:
        return [r for r in self.victim_order() if r.priority > request.priority]
