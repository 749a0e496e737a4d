"""Recurrent-state slots (hybrid linear-attention models): the scheduler allocates one per
running request at admission, frees it at finish, abort and preemption, admits no request
without one, turns the prefix cache off, and the engine's mirror checks every slot it is sent
(tests/scheduler_harness.py's fake engine, through the real contract)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmserve.common.step_plan import NewRequest, StepPlanData
from llmserve.engine.contract.mirror import Mirror, MirrorMismatch
from llmserve.scheduler.request import RequestStatus
from llmserve.scheduler.state_slots import StateSlots
from tests.factories import sampling
from tests.scheduler_harness import Harness, make_request


def slots_of(plan) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
    return [(row.request.seq_id, row.state_slot) for row in plan.new_requests]


def test_admission_waits_for_a_free_slot_and_finish_frees_it() -> None:
    h = Harness(num_state_slots=2, max_num_seqs=8, mirror=True)
    a, b, c = make_request(1, 4, 2), make_request(2, 4, 3), make_request(3, 4, 2)
    h.add(a, b, c)
    plan, _ = h.step()
    assert slots_of(plan) == [(1, 0), (2, 1)]  # c waits: no slot, though seats and blocks are free
    assert list(h.s.waiting) == [c] and h.s.state_slots.num_free_slots == 0
    h.step()  # a finishes (2 tokens): its slot 0 goes back
    assert h.finished == {1: RequestStatus.FINISHED_LENGTH} and a.state_slot is None
    plan, _ = h.step()
    assert slots_of(plan) == [(3, 0)]
    h.run_until_idle()
    assert h.s.state_slots.num_free_slots == 2
    assert h.outputs == {1: [10, 11], 2: [10, 11, 12], 3: [10, 11]}


def test_abort_frees_the_slot_for_the_next_request() -> None:
    h = Harness(num_state_slots=1, mirror=True)
    a, b = make_request(1, 4, 8), make_request(2, 4, 2)
    h.add(a, b)
    plan, _ = h.step()
    assert slots_of(plan) == [(1, 0)]
    h.s.abort(1)
    assert a.state_slot is None and h.s.state_slots.num_free_slots == 1
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1] and slots_of(plan) == [(2, 0)]
    h.run_until_idle()


def test_preemption_frees_the_slot_and_recomputes_from_the_first_token() -> None:
    # 4 blocks of 4: a and b fill them; a's growth preempts b, whose slot goes back, and b
    # comes back later as a new request computing from token 0 (no prefix-cache hit).
    h = Harness(num_blocks=4, max_num_seqs=2, num_state_slots=2, mirror=True)
    a, b = make_request(1, 4, 8), make_request(2, 4, 8)
    h.add(a, b)
    h.step()
    while b.status == RequestStatus.RUNNING:
        h.step()
    assert b.num_preemptions == 1 and b.state_slot is None
    assert h.s.state_slots.num_free_slots == 1
    h.run_until_idle()
    readmitted = [row for p in h.plans for row in p.new_requests if row.request is b][1]
    assert readmitted.num_computed_tokens == 0 and readmitted.state_slot in (0, 1)
    assert h.outputs[2] == list(range(10, 18)) and h.outputs[1] == list(range(10, 18))


def test_slots_turn_the_prefix_cache_off() -> None:
    h = Harness(num_state_slots=2, enable_prefix_caching=True, mirror=True)
    prompt = list(range(1, 10))
    h.add(make_request(1, 9, 1, prompt=prompt))
    h.run_until_idle()
    h.add(make_request(2, 9, 1, prompt=prompt))
    plan, _ = h.step()
    assert plan.new_requests[0].num_computed_tokens == 0  # no hit on the same prompt
    assert h.s.enable_prefix_caching is False and h.s.counters.num_prefix_cache_hit_tokens == 0
    without = Harness(enable_prefix_caching=True)
    assert without.s.enable_prefix_caching is True and without.s.state_slots.enabled is False


def test_reset_engine_frees_every_slot_and_resize_adopts_a_new_count() -> None:
    h = Harness(num_state_slots=2, mirror=True)
    h.add(make_request(1, 4, 8), make_request(2, 4, 8))
    h.step()
    assert h.s.state_slots.num_free_slots == 0
    h.reset_engine()
    assert h.s.state_slots.num_free_slots == 2
    assert h.s.resize(h.num_blocks, 4, num_state_slots=3) == []
    assert h.s.state_slots.num_slots == 3 and h.s.enable_prefix_caching is False
    h.run_until_idle()


def test_integrity_check_catches_a_slot_held_twice() -> None:
    slots = StateSlots(2)
    a, b = make_request(1, 4, 1), make_request(2, 4, 1)
    a.status = b.status = RequestStatus.RUNNING
    slots.allocate(a)
    slots.check_integrity([a])
    b.state_slot = a.state_slot
    with pytest.raises(AssertionError, match="held twice"):
        slots.check_integrity([a, b])
    b.state_slot = None
    slots.free_slots.append(a.state_slot)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="both held and free"):
        slots.check_integrity([a])


def _new(seq_id: int, slot: int, num_computed: int = 0) -> NewRequest:
    return NewRequest(seq_id, [1, 2, 3], 3, sampling(), [seq_id], num_computed, 3 - num_computed,
                      state_slot=slot)  # fmt: skip


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([_new(1, 2)], r"state_slot=2 outside \[0, 2\)"),
        ([_new(1, 0), _new(2, 0)], "state_slot=0 is held by seq 1"),
        ([_new(1, 1, num_computed=1)], "computes from its first token"),
    ],
)
def test_mirror_refuses_a_bad_state_slot(rows: list[NewRequest], message: str) -> None:
    mirror = Mirror(4, 8, num_state_slots=2)
    with pytest.raises(MirrorMismatch, match=message):
        mirror.apply(StepPlanData(1, [], rows))


def test_the_service_adopts_the_engines_slots_and_reports_them() -> None:
    """From EngineInfo.num_state_slots: the scheduler's slots, GetStats' two counts, the prefix
    cache off with the reason for the start line; a restarted engine without state layers
    turns it back on."""
    asyncio.run(_adopt_state_slots())


async def _adopt_state_slots() -> None:
    from llmserve.engine.contract.contract import EngineInfo
    from llmserve.engine.contract.convert import info_to_proto
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.service.convert import stats_to_proto
    from llmserve.scheduler.service.service import SchedulerService

    def info(num_state_slots: int) -> Any:
        return info_to_proto(
            EngineInfo("m", 100, 64, (99,), 4, 16, "cpu", "none", 4, 64,
                       num_state_slots=num_state_slots)
        )  # fmt: skip

    service = SchedulerService(SchedulerConfig(enable_prefix_caching=True))
    service.link._on_engine_info(info(3))
    s = service.scheduler
    assert s is not None and s.state_slots.num_slots == 3 and not s.enable_prefix_caching
    assert "recurrent state" in service.link._prefix_caching()
    s.add(make_request(1, 4, 2))
    s.schedule()
    stats = stats_to_proto(service.stats())
    assert (stats.num_state_slots, stats.num_free_state_slots) == (3, 2)
    s.reset_engine()
    service.link._on_engine_info(info(0))
    assert s.state_slots.num_slots == 0 and s.enable_prefix_caching
    assert service.link._prefix_caching() == "on"


def test_the_echo_engine_reports_slots_and_checks_them() -> None:
    """--echo-num-state-slots: the echo engine's EngineInfo and its mirror's check, for cheap
    scheduler tests of a state model's contract."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig

    engine = EchoEngine(
        EngineConfig(block_size=4, num_kv_blocks=16), EchoEngineConfig(100, num_state_slots=2)
    )
    assert engine.info.num_state_slots == 2
    with pytest.raises(MirrorMismatch, match=r"state_slot=2 outside \[0, 2\)"):
        engine.mirror.apply(StepPlanData(1, [], [_new(1, 2)]))
    engine.reset()
    assert engine.mirror.num_state_slots == 2
