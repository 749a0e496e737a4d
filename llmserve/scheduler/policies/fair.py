"""The fair policy (`--scheduling-policy fair`): tenants share the server in proportion to their
weights, measured by the virtual token counter of scheduler/tenants.py (VTC, Sheng et al., OSDI'24).

Admission: the first waiting request of the waiting tenant with the smallest counter (running
requests are charged first). Preemption for fairness (reason "fair") takes the latest admitted
request of the tenant with the largest counter, only when that tenant is ahead by at least the
waiting request's prefill and holds more weighted seats than the waiter's would with one more:
on the counter gap alone, seats swung between two equal backlogged tenants (166 preemptions in
300 steps). Memory preemption picks the same victim. Why: docs/scheduling.md#policies.
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
        tenant = min(firsts, key=self.s.tenants.counter)  # ties: the tenant first in line
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
