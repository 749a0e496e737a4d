"""Per-tenant accounting: the service each tenant received, as token counts and as a virtual token
counter (VTC, Sheng et al., "Fairness in Serving Large Language Models", OSDI'24).

A tenant's counter grows as its tokens are scheduled:

    virtual_tokens += (prefill_weight * prefill tokens + decode_weight * decode tokens) / weight

The fair policy (scheduler/policies/fair.py) admits from the tenant with the smallest counter and preempts
from the one with the largest, so over any busy stretch tenants receive service in proportion to
their weights. Every policy keeps the ledger (a few additions per scheduled row): GetStats shows
every tenant's service under fcfs and priority too.

The weights, 1 per prefill token and 2 per decode token by default, are the ones the VTC paper
evaluates (OpenAI's prices then: an output token cost twice an input token). They match where the
time goes: a prefill token rides in a compute-bound matrix product with many others, while a
decode token costs a step's pass over the weights and a read of its whole KV history, so a
long-output tenant is charged more per token than a long-prompt one.

A position is charged once (`Request.ledger.num_charged_tokens`): a recompute after a preemption
is the scheduler's doing, not the tenant's, and is free; prefix-cache hits are not computed and are
free.

The lift (VTC's rule): a tenant that had no work queued or running and sends a request has its
counter raised to the smallest counter among tenants that do have work, so credit is not banked
while idle: a tenant returning after an hour does not lock the others out until it catches up.

Tenants are named by clients (the gateway's `user` field when it has no API keys), so the ledger
forgets idle ones beyond `max_idle` (the longest idle first): memory stays bounded whatever
names arrive. A forgotten tenant that returns starts again from the lift, and its token totals
in GetStats start again from 0.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_IDLE_TENANTS = 4096


@dataclass
class Tenant:
    name: str
    weight: float = 1.0
    virtual_tokens: float = 0.0
    # Requests it has queued or running.
    num_requests: int = 0
    # Tokens computed for it: prompt positions (prefill) and output positions (decode), each once.
    num_prompt_tokens: int = 0
    num_decode_tokens: int = 0
    # Tokens sampled for it and kept (streamed).
    num_generated_tokens: int = 0


class TenantLedger:
    def __init__(
        self,
        prefill_weight: float = 1.0,
        decode_weight: float = 2.0,
        max_idle: int = MAX_IDLE_TENANTS,
    ):
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.max_idle = max_idle
        self.tenants: dict[str, Tenant] = {}
        # Tenants with no request queued or running, the longest idle first.
        self.idle: OrderedDict[str, None] = OrderedDict()

    def __getitem__(self, name: str) -> Tenant:
        return self.tenants[name]

    def counter(self, name: str) -> float:
        return self.tenants[name].virtual_tokens

    def arrive(self, name: str, weight: float) -> Tenant:
        """A request of tenant name (weight > 0; <= 0 means 1) is queued: count it, adopt the
        weight it carries, and lift the counter of a tenant that had no work (see above)."""
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name)
        tenant.weight = weight if weight > 0 else 1.0
        if tenant.num_requests == 0:
            active = [t.virtual_tokens for t in self.tenants.values() if t.num_requests > 0]
            if active:
                tenant.virtual_tokens = max(tenant.virtual_tokens, min(active))
        tenant.num_requests += 1
        self.idle.pop(name, None)
        return tenant

    def leave(self, name: str) -> None:
        """A request of tenant name ended (finished or aborted)."""
        tenant = self.tenants[name]
        tenant.num_requests -= 1
        assert tenant.num_requests >= 0, f"tenant {name!r}: more requests ended than arrived"
        if tenant.num_requests == 0:
            self.idle[name] = None
            while len(self.idle) > self.max_idle:
                del self.tenants[self.idle.popitem(last=False)[0]]

    def count_generated(self, name: str, num_tokens: int = 1) -> None:
        """num_tokens were sampled and kept for a request of tenant name (which may have ended
        in the same update, and then been forgotten)."""
        tenant = self.tenants.get(name)
        if tenant is not None:
            tenant.num_generated_tokens += num_tokens

    def charge(self, name: str, num_prompt_tokens: int, start: int, end: int) -> None:
        """Positions [start, end) of a request of tenant name (whose prompt is num_prompt_tokens
        long) were scheduled for the first time:

            positions: |<- prompt: prefill ->|<- outputs: decode ->|
                              |<- [start, end) ->|
        """
        if end <= start:
            return
        tenant = self.tenants[name]
        num_prefill = max(0, min(end, num_prompt_tokens) - start)
        num_decode = end - start - num_prefill
        tenant.num_prompt_tokens += num_prefill
        tenant.num_decode_tokens += num_decode
        cost = self.prefill_weight * num_prefill + self.decode_weight * num_decode
        tenant.virtual_tokens += cost / tenant.weight
