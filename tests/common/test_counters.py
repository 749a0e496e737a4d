"""common/counters.py: the one rule both the scheduler service (its engines' counters, in dicts)
and the launcher (its replicas' SchedulerStats) add statistics up by."""

from __future__ import annotations

from llmserve.common.counters import add_into, summed
from llmserve.protos import scheduler_pb2
from llmserve.stats import summed_stats


def test_each_kind_of_field_adds_up_by_its_rule() -> None:
    assert summed([2, 3, 5]) == 10
    assert summed([0.5, 0.25]) == 0.75
    assert summed([False, True, False]) is True
    assert summed([{"a": 1}, {"a": 2, "b": 3}]) == {"a": 3, "b": 3}
    assert summed([[1, 2, 3], [10, 20]]) == [11, 22, 3]  # by position, the shorter padded
    assert summed([["x"], ["y", "z"]]) == ["x", "y", "z"]  # rows listed


def test_add_into_adds_known_fields_and_takes_new_ones() -> None:
    total = {"steps": 1, "by_reason": {"memory": 1}, "accepted": [1, 1]}
    add_into(total, {"steps": 2, "by_reason": {"memory": 2, "fair": 1}, "accepted": [1], "x": 7})
    assert total == {"steps": 3, "by_reason": {"memory": 3, "fair": 1}, "accepted": [2, 1], "x": 7}


def test_replicas_stats_sum_by_the_same_rule() -> None:
    one = scheduler_pb2.SchedulerStats(num_steps=3, num_running=2, ready=True)
    two = scheduler_pb2.SchedulerStats(num_steps=4, num_running=1, ready=False)
    one.num_preemptions_by_reason["memory"] = 2
    two.num_preemptions_by_reason["memory"] = 1
    two.num_preemptions_by_reason["fair"] = 5
    one.num_spec_accepted_tokens_per_pos.extend([4, 2])
    two.num_spec_accepted_tokens_per_pos.extend([1])
    total = summed_stats([one, two])
    assert (total.num_steps, total.num_running, total.ready) == (7, 3, False)
    assert dict(total.num_preemptions_by_reason) == {"memory": 3, "fair": 5}
    assert list(total.num_spec_accepted_tokens_per_pos) == [5, 2]
    assert summed_stats([one]) is one
