"""The one rule for adding up the schedulers' statistics, whatever holds them: numbers summed,
flags or-ed, maps summed by key, sequences of numbers summed by position, sequences of rows
(per-tenant or per-engine messages) listed one after another. The scheduler service adds its
engines' counters with it (disaggregated roles, in dicts) and the launcher its replicas'
SchedulerStats (llmserve/stats.py), so a new kind of field is taught to both at once."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any


def summed(values: Sequence[Any]) -> Any:
    """values (one field's value from each part, all of one kind) added up."""
    first = values[0]
    if isinstance(first, bool):
        return any(values)
    if isinstance(first, int | float):
        return sum(values)
    if isinstance(first, Mapping):
        total: dict[Any, Any] = {}
        for value in values:
            for key, n in value.items():
                total[key] = total.get(key, 0) + n
        return total
    if all(isinstance(x, int | float) for value in values for x in value):
        return [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
    return [row for value in values for row in value]


def add_into(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    """part's fields added into total's (a field total lacks is taken as it is)."""
    for name, value in part.items():
        total[name] = summed([total[name], value]) if name in total else value
