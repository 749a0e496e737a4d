"""Arithmetic over the schedulers' SchedulerStats, written once for `llmserve bench`, the
launcher's Stack and the bench/ studies: the counters accumulated between two readings
(`stats_delta`) and the sum of several replicas' readings (`summed_stats`, by the rule the
scheduler service also sums its engines with: common/counters.py).

A field is a counter (it only grows: steps, tokens, preemptions) unless GAUGES names it (a
level read as it is now: running, waiting, free blocks, a tenant's weight).
"""

from __future__ import annotations

from typing import Any

from llmserve.common.counters import summed
from llmserve.protos import scheduler_pb2

GAUGES = frozenset(
    {"num_running", "num_waiting", "num_free_blocks", "num_blocks", "weight", "ready", "draining",
     "num_state_slots", "num_free_state_slots", "num_state_snapshot_slots",
     "num_used_state_snapshot_slots"}
)  # fmt: skip


def _counter(name: str, after: float, before: float) -> float:
    """after - before for a counter; after for a gauge."""
    return float(after) - (0.0 if name in GAUGES else float(before))


def _tenant_rows(before: Any, after: Any) -> dict[str, dict[str, float]]:
    """Per tenant, by name: its counters' deltas and its gauges (a new tenant counts from 0)."""
    old = {t.tenant: t for t in before}
    rows: dict[str, dict[str, float]] = {}
    for t in after:
        was = old.get(t.tenant, type(t)())
        rows[t.tenant] = {
            f.name: _counter(f.name, getattr(t, f.name), getattr(was, f.name))
            for f in t.DESCRIPTOR.fields
            if f.name != "tenant"
        }
    return rows


def stats_delta(
    before: scheduler_pb2.SchedulerStats, after: scheduler_pb2.SchedulerStats
) -> dict[str, Any]:
    """The scheduler's counters accumulated between two scheduler_stats() readings, flat
    (gauges taken from after; a repeated counter, such as per proposal position, as a list)."""
    delta: dict[str, Any] = {}
    for descriptor in after.DESCRIPTOR.fields:
        k = descriptor.name
        a, b = getattr(after, k), getattr(before, k)
        if k == "tenants":  # per tenant, by name: its counters' deltas, its gauges
            delta[k] = _tenant_rows(b, a)
        elif k == "engines":  # disaggregated: each engine as it stands after
            delta[k] = [{f.name: v for f, v in row.ListFields()} for row in a]
        elif isinstance(a, int | float):
            delta[k] = _counter(k, a, b)
        elif hasattr(a, "keys"):  # a map of counters (preemptions by reason)
            delta[k] = {key: float(a[key]) - float(b.get(key, 0)) for key in a}
        else:  # a repeated counter (per proposal position)
            b = list(b) + [0] * (len(a) - len(b))
            delta[k] = [float(x - y) for x, y in zip(a, b, strict=False)]
    return delta


def summed_stats(
    replicas: list[scheduler_pb2.SchedulerStats],
) -> scheduler_pb2.SchedulerStats:
    """The replicas' stats summed by common/counters.py's rule (one replica: its own); ready
    only when every one is."""
    if len(replicas) == 1:
        return replicas[0]
    total = scheduler_pb2.SchedulerStats()
    for f in total.DESCRIPTOR.fields:
        value = summed([getattr(stats, f.name) for stats in replicas])
        if f.name == "ready":
            total.ready = all(stats.ready for stats in replicas)
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            getattr(total, f.name).update(value)
        elif f.is_repeated:
            getattr(total, f.name).extend(value)
        else:
            setattr(total, f.name, value)
    return total
