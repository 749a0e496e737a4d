"""The fair policy (`--scheduling-policy fair`): tenants share the server in proportion to their
weights, measured by the virtual token counter of scheduler/tenants.py (VTC, Sheng et al., OSDI'24).

- Admission: the next request admitted is the first waiting one (arrival order; a preempted one
  first) of the waiting tenant with the smallest counter. Running requests are charged before
  admission is decided, so a tenant that is being served falls behind one that waits.
- Work conservation: only tenants with waiting requests compete; a tenant with nothing queued
  leaves its share to the others, and the lift (tenants.py) keeps it from banking credit.
- Preemption for fairness (reason "fair"): a waiting request that finds no seat or no blocks may
  preempt a running request of another tenant whose counter is ahead of its own tenant's by at
  least the prefill its admission computes (all its tokens, prefill-weighted, divided by its
  tenant's weight; at least one decode token's worth). A new request is charged that much when
  admitted, so its tenant is still not ahead of the victim's and the victim's tenant cannot
  preempt back at once. A preempted request coming back is charged nothing (a recompute is free),
  but it must still find its tenant that far behind: without that margin the two tenants' seats
  would change hands every few steps, each time paying for a recompute.
  And only while its tenant holds fewer seats than the victim's, weighted: (seats + 1) / weight
  <= the victim tenant's seats / weight. Counters integrate service over time, so a tenant that
  has caught up on seats keeps falling behind on counters for a while; preempting on the counter
  gap alone overshoots, and the seats swing from one tenant to the other and back (measured: 166
  preemptions in 300 steps of two equal backlogged tenants). Past seat parity, admission order
  alone (the smallest counter first as seats free up) evens out the service, as in VTC itself,
  which never preempts.
- Memory preemption (reason "memory"), and the victim of a fair one: the latest admitted running
  request of the tenant with the largest counter (ties: the latest admitted overall).
"""

from __future__ import annotations

from collections import Counter

from llmserve.scheduler.policies.base import Policy
from llmserve.scheduler.request import Request


class FairPolicy(Policy):
    room_reason = "fair"

    def next_waiting(self) -> Request:
        """The first waiting request of the waiting tenant with the smallest counter (ties: the
        tenant whose first request is earliest in line)."""
        firsts: dict[str, Request] = {}
        for request in self.s.waiting:
            firsts.setdefault(request.tenant, request)
        tenant = min(firsts, key=self.s.tenants.counter)  # dicts keep line order: ties go first
        return firsts[tenant]

    def victim_order(self) -> list[Request]:
        """Running requests by their tenant's counter, largest first; within it, the latest
        admitted first (running is in admission order)."""
        order = list(enumerate(self.s.running))
        order.sort(key=lambda ir: (self.s.tenants.counter(ir[1].tenant), ir[0]), reverse=True)
        return [r for _, r in order]

    def room_candidates(self, request: Request) -> list[Request]:
        ledger = self.s.tenants
        own = ledger[request.tenant]
        cost = max(ledger.prefill_weight * request.num_tokens, ledger.decode_weight) / own.weight
        seats = Counter(r.tenant for r in self.s.running)
        own_share = (seats[request.tenant] + 1) / own.weight

        def may_lose_a_seat(tenant: str) -> bool:
            behind = ledger.counter(tenant) - own.virtual_tokens >= cost
            return behind and own_share <= seats[tenant] / ledger[tenant].weight

        return [
            r
            for r in self.victim_order()
            if r.tenant != request.tenant and may_lose_a_seat(r.tenant)
        ]
