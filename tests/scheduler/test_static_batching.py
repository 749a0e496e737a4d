"""Static batching, the baseline (scheduler/policies/static_batching.py), driven by a fake
engine step (tests/scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import RequestStatus
from tests.scheduler_harness import (
    Harness,
    make_request,
    new_rows,
    outcome_rows,
    running_rows,
)

# -- static batching ------------------------------------------------------------------------------


def test_static_batch_pads_and_admits_nobody_until_it_drains(make: Callable[..., Harness]) -> None:
    h = make(scheduling_policy="static", max_num_seqs=2)
    a, b, c = make_request(1, 3, 1), make_request(2, 3, 3), make_request(3, 2, 2)
    h.add(a, b, c)
    length = RequestStatus.FINISHED_LENGTH
    plan, outcomes = h.step()
    assert new_rows(plan) == [
        (1, a.prompt_token_ids, [0], 0, 3),
        (2, b.prompt_token_ids, [1], 0, 3),
    ]
    # a is finished for its client at once, but stays in the batch as padding.
    assert outcome_rows(outcomes) == [(1, 10, length), (2, 10, None)]
    assert h.s.policy.padding == {1: length} and h.s.running == [a, b]

    # a keeps computing (its throwaway token 11 is never streamed); c is not admitted although
    # a slot would be free under continuous batching.
    plan, outcomes = h.step()
    assert (plan.finished_seq_ids, plan.new_requests) == ([], [])
    assert running_rows(plan) == [(1, 1, 3, []), (2, 1, 3, [])]
    assert outcome_rows(outcomes) == [(2, 11, None)]
    assert a.token_ids == [*a.prompt_token_ids, 10, 11]
    assert list(h.s.waiting) == [c]

    # The padding row grows into a new block like any request; b's last token drains the batch.
    plan, outcomes = h.step()
    assert running_rows(plan) == [(1, 1, 4, [2]), (2, 1, 4, [3])]
    assert outcome_rows(outcomes) == [(2, 12, length)]
    assert h.s.running == [] and h.s.policy.padding == {}
    assert h.s.block_manager.num_free_blocks == 16

    # Only now the next batch: c, with both drained members listed for the engine.
    plan, outcomes = h.step()
    assert plan.finished_seq_ids == [1, 2]
    assert new_rows(plan) == [(3, c.prompt_token_ids, [4], 0, 2)]
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11, 12], 3: [10, 11]}
    assert h.s.counters.finish_reasons == {"length": 3}
    assert h.s.counters.num_preemptions == 0


def test_static_batch_waits_to_fill_up_to_its_deadline(make: Callable[..., Harness]) -> None:
    """A new static batch starts when max_num_seqs requests wait, or when the first has waited
    static_batch_wait_ms; until then the plan is empty and the service sleeps that long."""
    h = make(scheduling_policy="static", max_num_seqs=3, static_batch_wait_ms=60_000)
    a, b, c, d = (make_request(i, 3, 2) for i in range(1, 5))
    h.add(a)
    assert h.s.schedule().is_empty
    wait = h.s.idle_timeout_s()
    assert wait is not None and 59 < wait <= 60
    h.add(b, c, d)  # three waiting: a full batch starts at once, d waits for the next
    assert h.s.idle_timeout_s() is None
    plan, _ = h.step()
    assert [r.request.seq_id for r in plan.new_requests] == [1, 2, 3]
    assert h.s.idle_timeout_s() is None  # a batch is running
    h.step()  # the batch drains (2 tokens each)
    assert h.s.running == [] and list(h.s.waiting) == [d]
    plan = h.s.schedule()  # d's batch is forming (the plan only tells the engine to drop 1-3) ...
    assert (plan.finished_seq_ids, plan.new_requests, plan.running) == ([1, 2, 3], [], [])
    d.arrival_time -= 61  # ... until its deadline has passed
    assert h.s.idle_timeout_s() == 0.0
    plan, _ = h.step()
    assert [r.request.seq_id for r in plan.new_requests] == [4]
    h.run_until_idle()
    h.check()


def test_continuous_batching_admits_into_the_freed_slot(make: Callable[..., Harness]) -> None:
    """The same requests as above without static batching: c joins at step 2."""
    h = make(max_num_seqs=2)
    h.add(make_request(1, 3, 1), make_request(2, 3, 3), make_request(3, 2, 2))
    h.step()
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert [r.request.seq_id for r in plan.new_requests] == [3]
    assert running_rows(plan) == [(2, 1, 3, [])]


def test_static_batch_fits_every_member_padded(make: Callable[..., Harness]) -> None:
    """a (4 + 4 tokens) and b (4 + 1, padded to 4 + 4) need 2 blocks each; 3 are free, so b
    waits for the next batch, while continuous batching runs both at once."""
    h = make(scheduling_policy="static", num_blocks=3)
    a, b = make_request(1, 4, 4), make_request(2, 4, 1)
    h.add(a, b)
    plan, _ = h.step()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0], 0, 4)]
    assert h.s.policy.batch_pending == set() and list(h.s.waiting) == [b]
    for _ in range(3):
        plan, _ = h.step()
        assert [r.seq_id for r in plan.requests] == [1]
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert [r.request.seq_id for r in plan.new_requests] == [2]
    h.run_until_idle()
    assert h.outputs == {1: [10, 11, 12, 13], 2: [10]}

    c = make(num_blocks=3)
    c.add(make_request(1, 4, 4), make_request(2, 4, 1))
    plan, _ = c.step()
    assert [r.request.seq_id for r in plan.new_requests] == [1, 2]


def test_static_padding_stops_at_max_model_len(make: Callable[..., Harness]) -> None:
    h = make(scheduling_policy="static", max_model_len=8)
    a, b = make_request(1, 5, 1), make_request(2, 4, 4)
    h.add(a, b)
    h.step()
    h.step()
    plan, outcomes = h.step()  # a's padding reaches 8 tokens: it ends; b still decodes
    assert running_rows(plan) == [(1, 1, 6, []), (2, 1, 5, [])]
    assert outcome_rows(outcomes) == [(2, 12, None)]
    assert a.num_tokens == 8 and a.status == RequestStatus.FINISHED_LENGTH
    assert h.s.running == [b] and h.s.policy.padding == {}
    plan, outcomes = h.step()
    assert plan.finished_seq_ids == [1]
    assert running_rows(plan) == [(2, 1, 6, [])]
    assert outcome_rows(outcomes) == [(2, 13, RequestStatus.FINISHED_LENGTH)]
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11, 12, 13]}


def test_static_padding_gives_its_block_up_instead_of_preempting(
    make: Callable[..., Harness],
) -> None:
    """A 4-token budget splits b's prefill, so a pads longer than its reservation; when it needs
    a fourth block there is none, and the padding row ends rather than preempt anyone."""
    h = make(scheduling_policy="static", num_blocks=3, max_num_batched_tokens=4)
    a, b = make_request(1, 2, 1), make_request(2, 6, 2)
    h.add(a, b)
    plan, outcomes = h.step()
    assert new_rows(plan) == [
        (1, a.prompt_token_ids, [0], 0, 2),
        (2, b.prompt_token_ids, [1], 0, 2),
    ]
    assert outcome_rows(outcomes) == [(1, 10, RequestStatus.FINISHED_LENGTH)]
    plan, _ = h.step()
    assert running_rows(plan) == [(1, 1, 2, []), (2, 3, 2, [2])]
    plan, outcomes = h.step()
    assert running_rows(plan) == [(1, 1, 3, []), (2, 1, 5, [])]
    assert outcome_rows(outcomes) == [(2, 10, None)]
    plan, outcomes = h.step()
    assert plan.finished_seq_ids == [1]  # a needed a block at position 4 and gave up
    assert running_rows(plan) == [(2, 1, 6, [])]
    assert outcome_rows(outcomes) == [(2, 11, RequestStatus.FINISHED_LENGTH)]
    assert h.s.counters.num_preemptions == 0
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11]}


def test_static_abort_and_engine_reset_end_the_padding(make: Callable[..., Harness]) -> None:
    h = make(scheduling_policy="static")
    a, b = make_request(1, 3, 1), make_request(2, 3, 5)
    h.add(a, b)
    h.step()
    h.step()
    assert h.s.policy.padding == {1: RequestStatus.FINISHED_LENGTH}
    h.s.abort(2)  # the last real member: the batch is over
    assert h.s.running == [] and h.s.requests == {}
    assert a.status == RequestStatus.FINISHED_LENGTH
    assert b.status == RequestStatus.FINISHED_ABORTED
    plan, _ = h.step()
    assert plan.finished_seq_ids == [2, 1] and plan.requests == []

    c, d = make_request(3, 3, 1), make_request(4, 3, 3)
    h.add(c, d)
    h.step()
    h.s.reset_engine()  # padding is freed, the real member recomputed later
    assert c.status == RequestStatus.FINISHED_LENGTH and c.num_preemptions == 0
    assert list(h.s.waiting) == [d] and d.num_preemptions == 1
    h.run_until_idle()
    assert h.outputs[3] == [10] and h.outputs[4] == [10, 11, 12]


def test_scheduling_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="scheduling_policy='fifo' must be one of continuous"):
        SchedulerConfig(scheduling_policy="fifo")
