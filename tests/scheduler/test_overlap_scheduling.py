"""Overlap: step N+1 planned before step N's result, driven by a fake engine step
(tests/scheduler_harness.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from llmserve.scheduler.request import RequestStatus
from tests.scheduler_harness import (
    EOS,
    Harness,
    eos_at,
    make_request,
    new_rows,
    outcome_rows,
    random_case,
    run_case,
    running_rows,
)

# -- overlap: step N+1 planned before step N's result --------------------------------------------


def test_overlap_plans_ahead_on_pending_tokens(make: Callable[..., Harness]) -> None:
    h = make(mirror=True)
    a = make_request(1, 3, 4)
    h.add(a)
    plan = h.plan()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0], 0, 3)]
    assert plan.new_requests[0].samples
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_tokens) == (3, 1, 4)

    # Step 2 computes the placeholder for step 1's token (slot 3 of block 0) and samples again.
    plan = h.plan()
    assert running_rows(plan) == [(1, 1, 3, [])] and plan.running[0].samples
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_tokens) == (4, 2, 5)
    assert outcome_rows(h.result()) == [(1, 10, None)]
    assert a.token_ids == [*a.prompt_token_ids, 10] and a.num_pending_tokens == 1

    # Step 3's placeholder sits at position 4: its block is allocated before the token is known.
    plan = h.plan()
    assert running_rows(plan) == [(1, 1, 4, [1])]
    assert a.block_table == [0, 1]
    assert outcome_rows(h.result()) == [(1, 11, None)]
    plan = h.plan()
    assert running_rows(plan) == [(1, 1, 5, [])]
    assert outcome_rows(h.result()) == [(1, 12, None)]

    # Output 3 is the last (max_tokens=4) and is pending: nothing is scheduled past it.
    assert (a.num_output_tokens, a.num_pending_tokens) == (3, 1)
    plan = h.plan()
    assert plan.is_empty
    assert outcome_rows(h.result()) == [(1, 13, RequestStatus.FINISHED_LENGTH)]
    assert a.block_table == [] and h.s.block_manager.num_free_blocks == 16
    plan = h.plan()
    assert plan.finished_seq_ids == [1] and plan.rows == []
    h.result()
    assert h.outputs == {1: [10, 11, 12, 13]}
    assert not h.s.has_work and not h.in_flight
    assert [p.step_id for p in h.plans] == [1, 2, 3, 4, 6]  # step 5 was empty, never sent
    assert h.s.counters.num_steps == 5


def test_overlap_max_tokens_one_is_never_scheduled_ahead(make: Callable[..., Harness]) -> None:
    h = make(mirror=True)
    a = make_request(1, 3, 1)
    h.add(a)
    h.plan()
    assert h.plan().is_empty
    assert outcome_rows(h.result()) == [(1, 10, RequestStatus.FINISHED_LENGTH)]
    assert h.s.block_manager.num_free_blocks == 16


def test_overlap_token_after_eos_is_dropped(make: Callable[..., Harness]) -> None:
    """a's output 1 is EOS, unforeseeable: step 3 samples a's output 2, which is never streamed;
    a's blocks are free when step 2's result arrives, and the engine hears of it in step 4."""
    h = make(mirror=True)
    a, b = make_request(1, 3, 10), make_request(2, 2, 10)
    h.add(a, b)
    token_for = eos_at(1)
    h.plan(token_for)
    h.plan(token_for)
    assert outcome_rows(h.result()) == [(1, 10, None), (2, 10, None)]
    plan = h.plan(token_for)  # both scheduled ahead: nobody knows a's output 1 is EOS
    assert [r.request.seq_id for r in plan.running] == [1, 2]
    assert outcome_rows(h.result()) == [
        (1, EOS, RequestStatus.FINISHED_STOPPED),
        (2, EOS, RequestStatus.FINISHED_STOPPED),
    ]
    assert a.block_table == [] and h.s.block_manager.num_free_blocks == 16
    assert a.num_pending_tokens == 0
    plan = h.plan(token_for)
    assert plan.finished_seq_ids == [1, 2] and plan.rows == []
    assert h.result() == []  # step 3's tokens for a and b: dropped
    h.result()
    assert a.token_ids == [*a.prompt_token_ids, 10, EOS]
    assert h.outputs == {1: [10, EOS], 2: [10, EOS]}


def test_overlap_abort_with_two_steps_in_flight(make: Callable[..., Harness]) -> None:
    h = make(mirror=True)
    a, b = make_request(1, 4, 10), make_request(2, 4, 10)
    h.add(a, b)
    h.plan()
    h.plan()
    h.s.abort(1)
    assert a.block_table == [] and a.status == RequestStatus.FINISHED_ABORTED
    assert h.s.block_manager.num_free_blocks == 14
    assert outcome_rows(h.result()) == [(2, 10, None)]
    plan = h.plan()
    assert plan.finished_seq_ids == [1] and running_rows(plan) == [(2, 1, 5, [])]
    assert outcome_rows(h.result()) == [(2, 11, None)]
    h.run_overlapped()
    assert h.outputs == {2: list(range(10, 20))}  # nothing of a's: aborted before its output


def test_overlap_chunked_prefill_chunks_in_flight(make: Callable[..., Harness]) -> None:
    """Two chunks of one prompt in flight at once: neither samples; the last chunk does, and the
    next step decodes its placeholder."""
    h = make(mirror=True, max_num_batched_tokens=4)
    a = make_request(1, 10, 2)
    h.add(a)
    plan = h.plan()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0], 0, 4)]
    plan = h.plan()
    assert running_rows(plan) == [(1, 4, 4, [1])] and not plan.running[0].samples
    assert h.result() == []
    plan = h.plan()
    assert running_rows(plan) == [(1, 2, 8, [2])] and plan.running[0].samples
    assert a.num_pending_tokens == 1
    assert h.result() == []
    plan = h.plan()
    assert running_rows(plan) == [(1, 1, 10, [])]
    assert outcome_rows(h.result()) == [(1, 10, None)]
    assert h.plan().is_empty  # output 1 is pending and the last
    assert outcome_rows(h.result()) == [(1, 11, RequestStatus.FINISHED_LENGTH)]


def test_overlap_preemption_of_a_request_in_flight(make: Callable[..., Harness]) -> None:
    """As test_preemption_newest_first_recomputed_without_reemitting, with step N+1 planned
    before step N's result: b is preempted while its output 14 is in flight; that token is
    dropped, and b samples output 14 again when recomputed (the same token: it depends only on
    the output index), never streaming anything twice."""
    h = make(num_blocks=4, max_num_seqs=2, mirror=True)
    a = make_request(1, 4, 8)
    b = make_request(2, 4, 8)
    c = make_request(3, 2, 1)
    h.add(a, b, c)
    h.plan()
    plan = h.plan()
    assert running_rows(plan) == [(1, 1, 4, [2]), (2, 1, 4, [3])]
    for computed in (5, 6, 7):
        h.result()
        plan = h.plan()
        assert running_rows(plan) == [(1, 1, computed, []), (2, 1, computed, [])]
    h.result()
    assert (b.num_output_tokens, b.num_pending_tokens) == (4, 1)

    # Step 6: a needs a third block; b, whose output 14 is in step 5, is preempted.
    plan = h.plan()
    assert plan.step_id == 6 and plan.finished_seq_ids == [2]
    assert running_rows(plan) == [(1, 1, 8, [3])]
    assert b.status == RequestStatus.WAITING
    assert (b.block_table, b.num_computed_tokens, b.num_pending_tokens) == ([], 0, 0)
    b_tokens = [*b.prompt_token_ids, 10, 11, 12, 13]
    assert b.token_ids == b_tokens
    assert outcome_rows(h.result()) == [(1, 14, None)]  # step 5: b's token dropped
    assert b.token_ids == b_tokens and list(h.s.waiting) == [b, c]

    h.run_overlapped()
    assert h.outputs == {1: list(range(10, 18)), 2: list(range(10, 18)), 3: [10]}
    assert b.num_preemptions == 1
    assert [i for p in h.plans for i in p.finished_seq_ids] == [2, 1, 3, 2]
    recompute = next(p for p in h.plans if p.new_requests and p.new_requests[0].request is b)
    assert recompute.new_requests[0].token_ids == b_tokens


def test_overlap_engine_reset_with_steps_in_flight(make: Callable[..., Harness]) -> None:
    """The engine dies with two steps in flight: both results are lost, every pending token is
    dropped, and recompute still produces every output exactly once."""
    h = make(mirror=True)
    reqs = [make_request(i, 3 + i, 6) for i in (1, 2, 3)]
    h.add(*reqs)
    h.plan()
    h.plan()
    h.result()
    h.plan()
    assert len(h.in_flight) == 2
    assert all(r.num_pending_tokens == 2 for r in reqs)
    h.reset_engine()
    assert all(r.num_pending_tokens == 0 and r.status == RequestStatus.WAITING for r in reqs)
    assert [r.num_output_tokens for r in reqs] == [1, 1, 1]
    h.run_overlapped()
    assert h.outputs == {i: list(range(10, 16)) for i in (1, 2, 3)}


@pytest.mark.parametrize("seed", range(40))
def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(seed: int) -> None:
    """Random workloads under random limits (chunked prefill, preemption, prefix caching, static
    batching, EOS at random outputs): planning ahead changes no output and no finish reason, the
    engine's Mirror accepts every plan, and the block manager is consistent after every step."""
    config, workload, token_for = random_case(random.Random(seed), static_batching=True)
    one_at_a_time = run_case(config, workload, token_for)
    overlapped = run_case(
        config, workload, token_for, lambda h: h.run_overlapped(token_for, max_steps=1000)
    )
    assert one_at_a_time == overlapped
