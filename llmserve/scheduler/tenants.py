"""Per-tenant accounting: each tenant's service as token counts and as a virtual token counter
(VTC), kept by every policy and read by the fair one (policies/fair.py) and GetStats. The
counter's rule, the weights' reason, the lift and why recomputes are free:
docs/scheduling.md#tenant-accounting.
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
