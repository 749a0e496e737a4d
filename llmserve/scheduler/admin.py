"""What operators read of the scheduler: one row per request (ListRequests), one per tenant and
the cumulative counters (GetStats, the metrics)."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from llmserve.scheduler.block_manager import held_blocks
from llmserve.scheduler.request import Request
from llmserve.scheduler.speculation import SpecCounters
from llmserve.scheduler.tenants import TenantLedger


@dataclass
class RequestRow:
    """One request as ListRequests shows it (fields as scheduler.proto's RequestState)."""

    request_id: str
    tenant: str
    state: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_preemptions: int
    age_s: float


@dataclass
class TenantRow:
    """One tenant as GetStats shows it (fields as scheduler.proto's TenantStats)."""

    tenant: str
    weight: float
    num_waiting: int
    num_running: int
    num_blocks: int
    num_prompt_tokens: int
    num_generated_tokens: int
    virtual_tokens: float


@dataclass
class SchedulerCounters:
    """Cumulative counts since start; GetStats and the metrics both read them."""

    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_preemptions: int = 0
    # Why (memory, priority, fair, engine_reset); the counts sum to num_preemptions.
    num_preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    # Preemptions wanted whose candidates were protected (max_preemptions, grace steps): at most
    # one per decision (a block for a running request, a seat or blocks for a waiting one).
    num_preemptions_refused: int = 0
    num_finished_requests: int = 0
    num_prompt_tokens: int = 0  # prompts of requests admitted for the first time
    num_generated_tokens: int = 0
    # Tokens looked up in the prefix cache at each admission (readmissions too), and found.
    num_prefix_cache_query_tokens: int = 0
    num_prefix_cache_hit_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    spec: SpecCounters = field(default_factory=SpecCounters)


def request_rows(requests: Iterable[Request], tenant: str = "") -> list[RequestRow]:
    """A row per request of requests (in their order), or per one of tenant's."""
    now = time.monotonic()
    return [
        RequestRow(
            request_id=r.request_id,
            tenant=r.tenant,
            state=r.status.value,
            priority=r.priority,
            num_prompt_tokens=r.num_prompt_tokens,
            num_output_tokens=r.num_output_tokens,
            num_computed_tokens=r.num_computed_tokens,
            num_blocks=len(held_blocks(r)),
            num_preemptions=r.num_preemptions,
            age_s=now - r.arrival_time,
        )
        for r in requests
        if not tenant or r.tenant == tenant
    ]


def tenant_rows(
    ledger: TenantLedger, waiting: Iterable[Request], running: Iterable[Request]
) -> list[TenantRow]:
    """A row per tenant of ledger, with its queue (waiting), seats and blocks (running) and
    service."""
    rows = {
        t.name: TenantRow(
            t.name, t.weight, 0, 0, 0, t.num_prompt_tokens, t.num_generated_tokens,
            t.virtual_tokens,
        )
        for t in ledger.tenants.values()
    }  # fmt: skip
    for r in waiting:
        rows[r.tenant].num_waiting += 1
    for r in running:
        rows[r.tenant].num_running += 1
        rows[r.tenant].num_blocks += len(held_blocks(r))
    return list(rows.values())
