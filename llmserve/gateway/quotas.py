"""Per-tenant quotas at the gateway: tokens per minute and concurrent requests.

Tokens per minute is a token bucket per tenant; a request reserves its worst case at admission
(per choice: prompt tokens + max_tokens) and is refunded what it did not use when it ends.
Reserving the worst case is what makes a refusal's Retry-After exact. A request that could never
fit the bucket is INVALID_ARGUMENT, not a 429. Concurrent requests count the tenant's sequences
in flight here. Everything reads time from `clock`, so tests drive it exactly. The rules and
Retry-After: docs/tenants.md#quotas-and-429.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.gateway.tenants import TenantLimits, TenantTable, display_name

DURATION_EMA = 0.2  # weight of the newest request's duration in the mean
MIN_RETRY_AFTER_S = 1
SWEEP_EVERY = 1024  # admissions between two sweeps of idle tenants' state


class QuotaExceeded(Exception):
    """Over a quota now: retry after retry_after_s seconds. reason: the quota's name
    ("tokens_per_minute" or "max_concurrent_requests")."""

    def __init__(self, tenant: str, reason: str, message: str, retry_after_s: int):
        super().__init__(message)
        self.tenant, self.reason, self.message = tenant, reason, message
        self.retry_after_s = retry_after_s


class TooLarge(Exception):
    """A request no quota could ever admit (it exceeds the limit itself)."""

    def __init__(self, tenant: str, reason: str, message: str):
        super().__init__(message)
        self.tenant, self.reason, self.message = tenant, reason, message


@dataclass
class TenantUsage:
    """One tenant's quota state at this gateway."""

    level: float = 0.0  # tokens in the bucket (meaningful while tokens_per_minute > 0)
    updated: float = 0.0  # when level was last brought up to date
    capacity: int = 0  # the tokens_per_minute level was computed for
    num_in_flight: int = 0  # sequences
    started: dict[int, float] = field(default_factory=dict)  # admission id -> when admitted
    mean_duration_s: float | None = None


class Quotas:
    """The quota state of every tenant seen. A tenant with nothing in flight is forgotten once
    its state says nothing a new one would not: at once without limits, else when its bucket is
    full again (a sweep every SWEEP_EVERY admissions), so tenants named by `user` cannot grow it
    without bound."""

    def __init__(self, table: TenantTable, clock: Callable[[], float] = time.monotonic):
        self.table = table
        self.clock = clock
        self.usage: dict[str, TenantUsage] = {}
        self._next_id = 0

    def _refill(self, tenant: str, limits: TenantLimits, now: float) -> TenantUsage:
        usage = self.usage.setdefault(tenant, TenantUsage(updated=now))
        if usage.capacity:  # refilled at the rate it had until now
            rate = usage.capacity / 60.0
            usage.level = min(usage.capacity, usage.level + (now - usage.updated) * rate)
        usage.updated = now
        capacity = limits.tokens_per_minute
        if capacity != usage.capacity:  # a new limit, or a new tenant: start full, or clamp
            usage.level = capacity if usage.capacity == 0 else min(usage.level, capacity)
            usage.capacity = capacity
        return usage

    def admit(self, tenant: str, costs: list[int]) -> Admission:
        """Reserve costs (prompt + max_tokens, one per sequence) for tenant, or raise
        QuotaExceeded (retry later) or TooLarge (never). Changes nothing when it raises."""
        limits = self.table.limits(tenant)
        now = self.clock()
        if self._next_id % SWEEP_EVERY == SWEEP_EVERY - 1:
            self._forget_idle(now)
        usage = self._refill(tenant, limits, now)
        name = display_name(tenant)
        self._check_concurrency(tenant, name, limits, usage, len(costs), now)
        total = sum(costs)
        tpm = limits.tokens_per_minute
        if tpm and total > tpm:
            raise TooLarge(
                tenant,
                "tokens_per_minute",
                f"prompt tokens + max_tokens = {total} exceeds the quota of tenant {name!r}, "
                f"tokens_per_minute={tpm}; lower max_tokens",
            )
        if tpm and usage.level < total:
            wait = (total - usage.level) / (tpm / 60.0)
            raise QuotaExceeded(
                tenant,
                "tokens_per_minute",
                f"tenant {name!r} is over its quota of tokens_per_minute={tpm}: this request "
                f"reserves {total} tokens (prompt + max_tokens), {int(usage.level)} are left",
                max(MIN_RETRY_AFTER_S, math.ceil(wait - 1e-9)),
            )
        usage.level -= total if tpm else 0
        usage.num_in_flight += len(costs)
        self._next_id += 1
        usage.started[self._next_id] = now
        return Admission(self, tenant, self._next_id, total if tpm else 0, len(costs))

    def _check_concurrency(
        self, tenant: str, name: str, limits: TenantLimits, usage: TenantUsage, n: int, now: float
    ) -> None:
        limit = limits.max_concurrent_requests
        if not limit:
            return
        if n > limit:
            raise TooLarge(
                tenant,
                "max_concurrent_requests",
                f"n={n} sequences at once exceed the quota of tenant {name!r}, "
                f"max_concurrent_requests={limit}",
            )
        if usage.num_in_flight + n <= limit:
            return
        retry = MIN_RETRY_AFTER_S
        if usage.mean_duration_s is not None and usage.started:
            oldest_age = now - min(usage.started.values())
            retry = max(retry, math.ceil(usage.mean_duration_s - oldest_age - 1e-9))
        raise QuotaExceeded(
            tenant,
            "max_concurrent_requests",
            f"tenant {name!r} has {usage.num_in_flight} requests in flight; its quota is "
            f"max_concurrent_requests={limit}",
            retry,
        )

    def release(self, admission: Admission) -> None:
        """admission ended: refund what it reserved but did not use, count its duration."""
        limits = self.table.limits(admission.tenant)
        now = self.clock()
        usage = self._refill(admission.tenant, limits, now)
        if usage.capacity:
            usage.level = min(usage.capacity, usage.level + admission.unused)
        usage.num_in_flight -= admission.num_sequences
        started = usage.started.pop(admission.id)
        duration = now - started
        mean = usage.mean_duration_s
        usage.mean_duration_s = (
            duration if mean is None else mean + DURATION_EMA * (duration - mean)
        )
        unlimited = not (limits.tokens_per_minute or limits.max_concurrent_requests)
        if unlimited and usage.num_in_flight == 0:
            del self.usage[admission.tenant]

    def _forget_idle(self, now: float) -> None:
        for tenant, usage in list(self.usage.items()):
            limits = self.table.limits(tenant)
            if usage.num_in_flight == 0:
                level = self._refill(tenant, limits, now).level
                if level >= limits.tokens_per_minute:
                    del self.usage[tenant]

    def num_in_flight(self, tenant: str) -> int:
        usage = self.usage.get(tenant)
        return usage.num_in_flight if usage else 0


class Admission:
    """One admitted request's reservation: `use` counts what it consumed, `release` (once;
    later calls do nothing) ends it."""

    def __init__(self, quotas: Quotas | None, tenant: str, id_: int, reserved: int, n: int):
        self.quotas = quotas
        self.tenant = tenant
        self.id = id_
        self.reserved = reserved
        self.num_sequences = n
        self.used = 0
        self.released = False
        # Whoever runs the request took over releasing it (gateway/choices.py's run_choices: a
        # generator that never starts cannot release what it was handed).
        self.handed_over = False

    @property
    def unused(self) -> int:
        return max(0, self.reserved - self.used) if self.reserved else 0

    def use(self, num_tokens: int) -> None:
        self.used += num_tokens

    def release(self) -> None:
        if self.released or self.quotas is None:
            return
        self.released = True
        self.quotas.release(self)
