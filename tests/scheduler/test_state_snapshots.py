"""State snapshots (a hybrid model's prefix cache, scheduler/state_slots.py's StateSnapshots):
prefill chunks cut at block ends, a snapshot per chunk end up to the prompt's last full block,
hits capped at the deepest settled snapshot and restored from it, snapshots gone with their
blocks, least recently used first, and after an abort, a preemption or a reset nothing leaks
(every step's integrity check counts the snapshot slots). Block size 4; the harness's mirror
checks each restore and snapshot through the real contract."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmserve.common.step_plan import NewRequest, StepPlanData
from llmserve.engine.contract.mirror import Mirror, MirrorMismatch
from llmserve.scheduler.plan import StepPlan
from tests.factories import sampling
from tests.scheduler_harness import Harness, make_request

PROMPT = list(range(1, 12))  # 11 tokens: the last full block a hit can reach ends at 8


def snapshots_of(plan: StepPlan) -> list[tuple[int, int, int]]:
    """(seq_id, from slot, to slot) of each snapshot plan takes."""
    return [(s.request.seq_id, s.from_slot, s.to_slot) for s in plan.state_snapshots]


def harness(num_snapshot_slots: int = 4, **kwargs: Any) -> Harness:
    return Harness(
        num_state_slots=2, num_state_snapshot_slots=num_snapshot_slots, mirror=True, **kwargs
    )


def test_chunks_end_at_block_ends_and_each_takes_a_snapshot() -> None:
    """A 15-token prompt in 6-token steps: chunks of 4, 4, 4 (each cut to a block end, the
    last at the prompt's last full block, 12) and 3; a snapshot after each of the first three,
    into snapshot slots 2, 3, 4 (after the 2 request slots). Each is a hit only once its
    plan's result is in."""
    h = harness(max_num_batched_tokens=6)
    h.add(make_request(1, 15, 1))
    sizes, taken = [], []
    for _ in range(4):
        plan = h.s.schedule()
        h.plans.append(plan)
        sizes.append(plan.num_scheduled_tokens)
        taken += snapshots_of(plan)
        h._engine_step(plan, h.tokens_for(plan))
        assert len(h.s.state_slots.snapshots.pending) == len(plan.state_snapshots)
        h.finish_step(plan, h.tokens_for(plan))
    assert sizes == [4, 4, 4, 3]
    assert taken == [(1, 0, 2), (1, 0, 3), (1, 0, 4)]
    snapshots = h.s.state_slots.snapshots
    assert list(snapshots.cached.values()) == [2, 3, 4] and not snapshots.pending
    h.run_until_idle()


def test_a_hit_is_capped_at_the_deepest_snapshot_and_restores_it() -> None:
    """a (11 tokens, 2 out) leaves blocks 0-2 cached and a snapshot at 8 only; b, a's 12
    tokens and 7 more, finds 3 cached blocks but is capped at 2 (8 tokens), restored from the
    snapshot; its chunks stop where its cached prefix ends (12) and at its prompt's last full
    block (16), a snapshot at each."""
    h = harness()
    a = make_request(1, 11, 2, prompt=PROMPT)
    h.add(a)
    plan, _ = h.step()
    assert plan.new_requests[0].num_scheduled_tokens == 8 and snapshots_of(plan) == [(1, 0, 2)]
    h.run_until_idle()
    b = make_request(2, 19, 1, prompt=a.token_ids + list(range(50, 57)))
    h.add(b)
    assert len(h.s.block_manager.find_cached_blocks(b)) == 3
    plan, _ = h.step()
    (row,) = plan.new_requests
    assert (row.num_computed_tokens, row.num_scheduled_tokens, row.state_restore_from) == (8, 4, 2)
    assert snapshots_of(plan) == [(2, 1, 3)]  # at 12
    plan, _ = h.step()
    assert plan.num_scheduled_tokens == 4 and snapshots_of(plan) == [(2, 1, 4)]  # at 16
    assert h.s.counters.num_prefix_cache_hit_tokens == 8
    assert h.s.state_slots.snapshots.num_hits == 1
    h.run_until_idle()
    assert h.outputs == {1: [10, 11], 2: [10]}


def test_a_shared_prefix_leaves_a_snapshot_where_it_ends() -> None:
    """A shared 8-token "system prompt" before different 5-token questions: a's snapshot is at
    its own last block (12), so b finds the 8 shared tokens cached but no snapshot (no hit); b's
    first chunk stops at 8 and leaves one there, which c then hits."""
    shared = list(range(60, 68))
    h = harness()
    for seq_id in (1, 2, 3):
        h.add(make_request(seq_id, 13, 1, prompt=shared + [seq_id * 10 + i for i in range(5)]))
        plan, _ = h.step()
        (row,) = plan.new_requests
        firsts = (row.num_computed_tokens, row.num_scheduled_tokens, row.state_restore_from)
        assert firsts == {1: (0, 12, 0), 2: (0, 8, 0), 3: (8, 4, 3)}[seq_id]
        h.run_until_idle()
    assert h.s.counters.num_prefix_cache_hit_tokens == 8


def test_no_snapshot_no_hit_and_off_without_snapshot_slots() -> None:
    """The same prompt while a's snapshot is still being taken (its result not in) computes
    from token 0; without snapshot slots the prefix cache stays off."""
    h = harness()
    h.add(make_request(1, 11, 1, prompt=PROMPT))
    h.plan()  # a's first chunk and its snapshot in flight
    h.add(make_request(2, 11, 1, prompt=PROMPT))
    plan = h.plan()
    (row,) = plan.new_requests
    assert (row.num_computed_tokens, row.state_restore_from) == (0, 0)
    h.run_overlapped()
    assert harness(num_snapshot_slots=0).s.enable_prefix_caching is False


def test_a_snapshot_goes_with_its_block() -> None:
    """4 blocks: a's 3 blocks are cached after it ends; d's 13 tokens take all 4 blocks, and a's
    snapshot goes with its block: the same prompt then computes from 0."""
    h = harness(num_blocks=4)
    h.add(make_request(1, 11, 1, prompt=PROMPT))
    h.run_until_idle()
    snapshots = h.s.state_slots.snapshots
    assert len(snapshots.cached) == 1
    h.add(make_request(2, 13, 1))
    h.run_until_idle()
    assert list(snapshots.cached.values()) == [3]  # d's own, at 12; a's (slot 2) is gone
    assert list(snapshots.free_slots)[-1] == 2
    h.add(make_request(3, 11, 1, prompt=PROMPT))
    plan, _ = h.step()
    assert plan.new_requests[0].num_computed_tokens == 0
    h.run_until_idle()


def test_the_least_recently_used_snapshot_makes_room() -> None:
    """One snapshot slot: b's snapshot replaces a's (a's block stays cached), so a's prompt
    again finds blocks but no snapshot: no hit; then b's prompt hits."""
    h = harness(num_snapshot_slots=1, num_blocks=32)
    other = list(range(30, 41))
    for seq_id, prompt in ((1, PROMPT), (2, other)):
        h.add(make_request(seq_id, 11, 1, prompt=prompt))
        h.run_until_idle()
    snapshots = h.s.state_slots.snapshots
    assert snapshots.num_evicted == 1 and len(snapshots.cached) == 1
    h.add(make_request(3, 11, 1, prompt=PROMPT))
    plan, _ = h.step()
    assert plan.new_requests[0].num_computed_tokens == 0
    h.run_until_idle()
    h.add(make_request(4, 11, 1, prompt=PROMPT))  # request 3 took a's snapshot again
    plan, _ = h.step()
    assert plan.new_requests[0].state_restore_from == 2
    h.run_until_idle()


@pytest.mark.parametrize("how", ["abort", "preempt", "reset"])
def test_a_snapshot_whose_row_may_not_have_run_is_dropped(how: str) -> None:
    """A snapshot's plan in flight, then its request aborted (as a refused one is), preempted,
    or the engine reset: the snapshot never becomes a hit and its slot is free again."""
    h = harness()
    a = make_request(1, 11, 1, prompt=PROMPT)
    h.add(a)
    plan = h.plan()
    assert snapshots_of(plan) == [(1, 0, 2)]
    if how == "abort":
        h.s.abort(1)
    elif how == "preempt":
        h.s.running.remove(a)
        h.s.preempt(a, "memory")
    else:
        h.reset_engine()
    if h.in_flight:
        h.result()
    snapshots = h.s.state_slots.snapshots
    assert not snapshots.cached and not snapshots.pending and len(snapshots.free_slots) == 4
    h.run_until_idle()
    h.check()


def _new(seq_id: int, num_computed: int, restore: int) -> NewRequest:
    return NewRequest(seq_id, [1, 2, 3, 4, 5], 5, sampling(), [seq_id], num_computed,
                      5 - num_computed, state_slot=0, state_restore_from=restore)  # fmt: skip


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepPlanData(1, [], [_new(1, 4, 1)]), r"state_restore_from=1 is not a state snapshot"),
        (StepPlanData(1, [], [_new(1, 4, 0)]), "unless its state is restored"),
        (StepPlanData(1, [], [_new(1, 0, 3)]), "unless its state is restored"),
        (
            StepPlanData(1, [], [_new(1, 0, 0)], state_snapshot_from=[0], state_snapshot_to=[4]),
            r"state_snapshot_to=4 is not a state snapshot slot \[2, 4\)",
        ),
        (
            StepPlanData(1, [], [], state_snapshot_from=[2], state_snapshot_to=[3]),
            r"state_snapshot_from=2 outside \[0, 2\)",
        ),
    ],
)
def test_mirror_refuses_a_bad_restore_or_snapshot(plan: StepPlanData, message: str) -> None:
    mirror = Mirror(4, 8, num_state_slots=2, num_state_snapshot_slots=2)
    with pytest.raises(MirrorMismatch, match=message):
        mirror.apply(plan)


def test_the_service_turns_the_prefix_cache_on_with_snapshot_slots() -> None:
    """EngineInfo.num_state_snapshot_slots: the scheduler keeps snapshots, the prefix cache is
    on, GetStats and the /metrics gauges count the slots and those used."""
    asyncio.run(_adopt_snapshot_slots())


async def _adopt_snapshot_slots() -> None:
    from llmserve.engine.contract.contract import EngineInfo
    from llmserve.engine.contract.convert import info_to_proto
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.service.convert import stats_to_proto
    from llmserve.scheduler.service.service import SchedulerService
    from llmserve.scheduler.service.telemetry import SchedulerTelemetry

    info = info_to_proto(
        EngineInfo("m", 100, 64, (99,), 4, 16, "cpu", "none", 4, 64,
                   num_state_slots=2, num_state_snapshot_slots=3)
    )  # fmt: skip
    service = SchedulerService(SchedulerConfig(enable_prefix_caching=True))
    service.link._on_engine_info(info)
    s = service.scheduler
    assert s is not None and s.enable_prefix_caching and service.link._prefix_caching() == "on"
    s.add(make_request(1, 11, 1, prompt=PROMPT))
    plan = s.schedule()
    assert [(x.from_slot, x.to_slot) for x in plan.state_snapshots] == [(0, 2)]
    stats = stats_to_proto(service.stats())
    assert (stats.num_state_snapshot_slots, stats.num_used_state_snapshot_slots) == (3, 1)
    observe = SchedulerTelemetry(service.stats)._observe  # the /metrics gauges
    assert observe("num_used_state_snapshot_slots") == [(1, {})]
    assert observe("num_state_snapshot_slots") == [(3, {})]
