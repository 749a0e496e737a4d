"""Preemption, aborts, and an engine reset or resize, driven by a fake engine step
(tests/scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmserve.scheduler.admission import AdmissionError
from llmserve.scheduler.request import RequestStatus
from tests.scheduler_harness import (
    BS,
    Harness,
    make_request,
    new_rows,
    outcome_rows,
    running_rows,
)

# -- preemption ---------------------------------------------------------------------------------


def test_preemption_newest_first_recomputed_without_reemitting(
    make: Callable[..., Harness],
) -> None:
    h = make(num_blocks=4, max_num_seqs=2)
    a = make_request(1, 4, 8)
    b = make_request(2, 4, 8)
    c = make_request(3, 2, 1)  # waits: max_num_seqs
    h.add(a, b, c)
    plan, _ = h.step()
    assert new_rows(plan) == [
        (1, a.prompt_token_ids, [0], 0, 4),
        (2, b.prompt_token_ids, [1], 0, 4),
    ]
    plan, _ = h.step()
    assert running_rows(plan) == [(1, 1, 4, [2]), (2, 1, 4, [3])]
    for computed in (5, 6, 7):
        plan, _ = h.step()
        assert running_rows(plan) == [(1, 1, computed, []), (2, 1, computed, [])]
    assert h.s.block_manager.num_free_blocks == 0

    # Step 6: a (oldest) needs a third block; b (newest) is preempted and a takes b's last block.
    plan, outcomes = h.step()
    assert plan.step_id == 6
    assert plan.finished_seq_ids == [2]
    assert plan.new_requests == []
    assert running_rows(plan) == [(1, 1, 8, [3])]
    assert outcome_rows(outcomes) == [(1, 15, None)]
    assert b.status == RequestStatus.WAITING
    assert (b.block_table, b.num_computed_tokens, b.num_preemptions) == ([], 0, 1)
    assert b.mirror.in_engine is False
    assert list(h.s.waiting) == [b, c]  # the preempted request goes first in line
    assert h.s.running == [a]
    assert list(h.s.block_manager.free_blocks) == [1]
    assert h.s.counters.num_preemptions == 1
    b_tokens = [*b.prompt_token_ids, 10, 11, 12, 13, 14]
    assert b.token_ids == b_tokens

    # b needs 3 blocks (1 cached, still free, + 2); only 1 is free while a runs. c, behind it,
    # is not admitted past it.
    plan, _ = h.step()
    assert (plan.finished_seq_ids, plan.new_requests) == ([], [])
    assert running_rows(plan) == [(1, 1, 9, [])]
    plan, outcomes = h.step()
    assert outcome_rows(outcomes) == [(1, 17, RequestStatus.FINISHED_LENGTH)]

    # b comes back as a new request with its generated tokens; its first block is a cache hit.
    plan, outcomes = h.step()
    assert plan.finished_seq_ids == [1]
    assert new_rows(plan) == [(2, b_tokens, [1, 3, 2], 4, 5), (3, c.prompt_token_ids, [0], 0, 2)]
    assert outcome_rows(outcomes) == [(2, 15, None), (3, 10, RequestStatus.FINISHED_LENGTH)]
    assert b.num_cached_tokens == 0  # counted at first admission only
    h.run_until_idle()
    assert h.outputs == {1: list(range(10, 18)), 2: list(range(10, 18)), 3: [10]}
    length = RequestStatus.FINISHED_LENGTH
    assert h.finished == {1: length, 2: length, 3: length}
    assert [i for p in h.plans for i in p.finished_seq_ids] == [2, 1, 3, 2]


def test_preemption_picks_the_newest_of_three(make: Callable[..., Harness]) -> None:
    h = make(num_blocks=6)
    a, b, c = (make_request(i, 4, 12) for i in (1, 2, 3))
    h.add(a, b, c)
    h.step()
    plan, _ = h.step()
    assert running_rows(plan) == [(1, 1, 4, [3]), (2, 1, 4, [4]), (3, 1, 4, [5])]
    for _ in range(3):
        h.step()
    plan, _ = h.step()
    assert plan.finished_seq_ids == [3]
    assert running_rows(plan) == [(1, 1, 8, [5]), (2, 1, 8, [2])]
    assert [r.seq_id for r in h.s.waiting] == [3]
    h.run_until_idle()
    assert h.outputs == {i: list(range(10, 22)) for i in (1, 2, 3)}
    assert c.num_preemptions >= 1 and a.num_preemptions == 0


def test_request_that_needs_a_block_can_preempt_itself(make: Callable[..., Harness]) -> None:
    h = make(num_blocks=5)
    a, b, c = (make_request(i, 4, 8) for i in (1, 2, 3))
    h.add(a, b, c)
    plan, _ = h.step()
    assert [r.block_table for r in plan.requests] == [[0], [1], [2]]
    plan, _ = h.step()
    # a and b take 3 and 4; c, the newest, finds none and is preempted rather than anyone else.
    assert plan.finished_seq_ids == [3]
    assert running_rows(plan) == [(1, 1, 4, [3]), (2, 1, 4, [4])]
    assert list(h.s.waiting) == [c]
    assert c.token_ids == [*c.prompt_token_ids, 10]
    h.run_until_idle()
    assert h.outputs == {i: list(range(10, 18)) for i in (1, 2, 3)}


# -- abort --------------------------------------------------------------------------------------


def test_abort_waiting_request(make: Callable[..., Harness]) -> None:
    h = make(max_num_seqs=1)
    a, b = make_request(1, 3, 4), make_request(2, 3, 4)
    h.add(a, b)
    h.step()
    assert h.s.abort(2) is b
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert list(h.s.waiting) == [] and 2 not in h.s.requests
    assert h.s.abort(2) is None
    assert h.s.abort(99) is None
    plan, _ = h.step()
    assert plan.finished_seq_ids == []  # the engine never knew b
    assert h.s.counters.finish_reasons == {"abort": 1}


def test_abort_running_request_frees_blocks_at_once(make: Callable[..., Harness]) -> None:
    h = make()
    a, b = make_request(1, 6, 4), make_request(2, 3, 4)
    h.add(a, b)
    h.step()
    assert (a.block_table, b.block_table) == ([0, 1], [2])
    assert h.s.abort(1) is a
    assert a.block_table == []
    assert h.s.block_manager.num_free_blocks == 15
    assert list(h.s.block_manager.free_blocks)[-2:] == [1, 0]
    assert h.s.running == [b]
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert running_rows(plan) == [(2, 1, 3, [])]
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11, 12, 13]}


def test_in_flight_result_of_aborted_request_is_ignored(make: Callable[..., Harness]) -> None:
    h = make()
    a, b = make_request(1, 3, 4), make_request(2, 3, 4)
    h.add(a, b)
    plan = h.s.schedule()
    tokens = h.tokens_for(plan)
    assert tokens == [10, 10]
    h.s.abort(1)
    assert h.s.block_manager.num_free_blocks == 15
    outcomes = h.finish_step(plan, tokens)
    assert outcome_rows(outcomes) == [(2, 10, None)]
    assert a.token_ids == a.prompt_token_ids
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert [r.seq_id for r in plan.requests] == [2]


def test_abort_of_preempted_request_is_listed_once(make: Callable[..., Harness]) -> None:
    h = make(num_blocks=5)
    h.add(*(make_request(i, 4, 8) for i in (1, 2, 3)))
    h.step()
    h.step()  # 3 preempted
    assert [r.seq_id for r in h.s.waiting] == [3]
    h.s.abort(3)
    plan, _ = h.step()
    assert plan.finished_seq_ids == []
    assert [i for p in h.plans for i in p.finished_seq_ids] == [3]


# -- engine reset and resize --------------------------------------------------------------------


def test_reset_engine_preempts_everything_and_forgets_the_cache(
    make: Callable[..., Harness],
) -> None:
    h = make(max_num_seqs=3)
    a, b, c, d = (
        make_request(1, 5, 10),
        make_request(2, 5, 10),
        make_request(3, 2, 3),
        make_request(4, 2, 2),
    )
    h.add(a, b, d, c)
    h.step()
    _, outcomes = h.step()
    assert outcomes[-1].finished == RequestStatus.FINISHED_LENGTH  # d, pending for the engine
    assert h.s.block_manager.hash_to_block != {}
    h.s.reset_engine()
    assert h.s.running == []
    assert list(h.s.waiting) == [a, b, c]
    assert all(r.status == RequestStatus.WAITING for r in (a, b, c))
    assert [(r.num_computed_tokens, r.num_preemptions, r.mirror.in_engine) for r in (a, b)] == [
        (0, 1, False),
        (0, 1, False),
    ]
    assert h.s.block_manager.num_free_blocks == 16
    assert h.s.block_manager.hash_to_block == {} and h.s.block_manager.block_key == {}
    plan, _ = h.step()
    assert plan.finished_seq_ids == []  # the restarted engine knows nobody
    assert plan.running == []
    assert new_rows(plan) == [
        (1, [*a.prompt_token_ids, 10, 11], [5, 6], 0, 7),
        (2, [*b.prompt_token_ids, 10, 11], [7, 8], 0, 7),
        (3, c.prompt_token_ids, [9], 0, 2),
    ]
    h.run_until_idle()
    assert h.outputs == {
        1: list(range(10, 20)),
        2: list(range(10, 20)),
        3: [10, 11, 12],
        4: [10, 11],
    }


def test_resize_aborts_what_no_longer_fits(make: Callable[..., Harness]) -> None:
    h = make()
    a, c = make_request(1, 5, 10), make_request(3, 4, 3)
    h.add(a, c)
    h.step()
    old = h.s.block_manager
    assert h.s.resize(16, BS) == []
    assert h.s.block_manager is old
    with pytest.raises(AssertionError, match="running"):
        h.s.resize(4, 2)
    h.s.reset_engine()
    assert len(a.block_hashes) == 1 and len(c.block_hashes) == 1
    assert h.s.resize(4, 2) == [a]
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert list(h.s.waiting) == [c] and list(h.s.requests) == [3]
    assert c.block_hashes == []
    bm = h.s.block_manager
    assert (bm.num_blocks, bm.block_size, h.s.block_size) == (4, 2, 2)
    plan, _ = h.step()
    assert plan.finished_seq_ids == []
    assert new_rows(plan) == [(3, [*c.prompt_token_ids, 10], [0, 1, 2], 0, 5)]
    # Rehashed per 2-token block.
    t = c.token_ids
    h0 = hash((0, tuple(t[0:2])))
    assert c.block_hashes == [h0, hash((h0, tuple(t[2:4])))]
    with pytest.raises(AdmissionError, match="capacity of 8 tokens \\(4 blocks x 2\\)"):
        h.s.add(make_request(5, 5, 4))
    h.run_until_idle()
    assert h.outputs == {1: [10], 3: [10, 11, 12]}
