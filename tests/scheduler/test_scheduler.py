"""The Scheduler's batching, admission, stopping and prefix cache, driven by a fake engine step
(tests/scheduler_harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmserve.scheduler.admission import AdmissionError
from llmserve.scheduler.request import Request, RequestStatus
from tests.scheduler_harness import (
    EOS,
    VOCAB,
    Harness,
    eos_at,
    make_request,
    new_rows,
    outcome_rows,
    running_rows,
)

# -- batching -----------------------------------------------------------------------------------


def test_continuous_batching_admits_while_another_decodes(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 5, 3)
    h.add(a)
    plan, outcomes = h.step()
    assert (plan.step_id, plan.finished_seq_ids, plan.running) == (1, [], [])
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0, 1], 0, 5)]
    assert outcome_rows(outcomes) == [(1, 10, None)]

    b = make_request(2, 3, 2)
    h.add(b)
    plan, outcomes = h.step()
    assert plan.step_id == 2
    assert new_rows(plan) == [(2, b.prompt_token_ids, [2], 0, 3)]
    assert running_rows(plan) == [(1, 1, 5, [])]
    assert [r.seq_id for r in plan.requests] == [2, 1]  # new rows first
    assert outcome_rows(outcomes) == [(2, 10, None), (1, 11, None)]

    plan, outcomes = h.step()
    assert plan.new_requests == []
    assert running_rows(plan) == [(1, 1, 6, []), (2, 1, 3, [])]
    length = RequestStatus.FINISHED_LENGTH
    assert outcome_rows(outcomes) == [(1, 12, length), (2, 11, length)]
    assert h.s.running == [] and h.s.requests == {}
    assert a.token_ids == [*a.prompt_token_ids, 10, 11, 12]
    assert b.token_ids == [*b.prompt_token_ids, 10, 11]

    # The engine learns about the finished requests from the next plan, once.
    assert h.s.has_work
    plan, outcomes = h.step()
    assert (plan.step_id, plan.finished_seq_ids, plan.new_requests, plan.running) == (
        4,
        [1, 2],
        [],
        [],
    )
    assert not plan.is_empty and outcomes == []
    assert not h.s.has_work
    plan = h.s.schedule()
    assert plan.is_empty and plan.step_id == 5
    # a's blocks went back last block first, then b's.
    assert list(h.s.block_manager.free_blocks) == [*range(3, 16), 1, 0, 2]
    assert h.s.counters.num_finished_requests == 2
    assert h.s.counters.finish_reasons == {"length": 2}
    assert h.s.counters.num_steps == 4  # the empty plan is never sent: not a step
    assert h.s.counters.num_scheduled_tokens == 5 + 4 + 2


def test_chunked_prefill_mixed_with_decode(make: Callable[..., Harness]) -> None:
    h = make(max_num_batched_tokens=8)
    a = make_request(1, 3, 10)
    b = make_request(2, 18, 2)
    h.add(a)
    plan, _ = h.step()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0], 0, 3)]
    h.add(b)

    # a decodes 1 token, b's prompt takes the other 7 of the budget.
    plan, outcomes = h.step()
    assert new_rows(plan) == [(2, b.prompt_token_ids, [1, 2], 0, 7)]
    assert running_rows(plan) == [(1, 1, 3, [])]
    assert h.last_tokens == [-1, 11]
    assert outcome_rows(outcomes) == [(1, 11, None)]
    assert b.num_computed_tokens == 7 and b.num_output_tokens == 0

    # a needs its second block (id 3) before b's chunk takes 4 and 5.
    plan, outcomes = h.step()
    assert plan.new_requests == []
    assert running_rows(plan) == [(1, 1, 4, [3]), (2, 7, 7, [4, 5])]
    assert outcome_rows(outcomes) == [(1, 12, None)]

    # b's last 4 prompt tokens: it samples its first output.
    plan, outcomes = h.step()
    assert running_rows(plan) == [(1, 1, 5, []), (2, 4, 14, [6])]
    assert outcome_rows(outcomes) == [(1, 13, None), (2, 10, None)]

    plan, outcomes = h.step()
    assert running_rows(plan) == [(1, 1, 6, []), (2, 1, 18, [])]
    assert outcome_rows(outcomes) == [(1, 14, None), (2, 11, RequestStatus.FINISHED_LENGTH)]
    assert [p.num_scheduled_tokens for p in h.plans] == [3, 8, 8, 5, 2]
    assert b.token_ids == [*b.prompt_token_ids, 10, 11]

    h.run_until_idle()
    assert h.outputs == {1: list(range(10, 20)), 2: [10, 11]}
    # Each step id once, strictly increasing; each finished id listed once.
    assert [p.step_id for p in h.plans] == list(range(1, len(h.plans) + 1))
    listed = [i for p in h.plans for i in p.finished_seq_ids]
    assert listed == [2, 1]


def test_budget_admits_a_prompt_chunk(make: Callable[..., Harness]) -> None:
    h = make(max_num_batched_tokens=4)
    a = make_request(1, 3, 2)
    b = make_request(2, 5, 1)
    c = make_request(3, 2, 1)
    h.add(a, b, c)
    plan, _ = h.step()
    assert new_rows(plan) == [
        (1, a.prompt_token_ids, [0], 0, 3),
        (2, b.prompt_token_ids, [1], 0, 1),
    ]
    assert [r.seq_id for r in h.s.waiting] == [3]
    plan, _ = h.step()
    assert running_rows(plan) == [(1, 1, 3, []), (2, 3, 1, [])]
    assert plan.new_requests == []  # budget spent by the running requests
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert running_rows(plan) == [(2, 1, 4, [2])]
    assert new_rows(plan) == [(3, c.prompt_token_ids, [3], 0, 2)]
    h.run_until_idle()
    assert h.outputs == {1: [10, 11], 2: [10], 3: [10]}


def test_running_decodes_beyond_the_budget_wait(make: Callable[..., Harness]) -> None:
    h = make(max_num_batched_tokens=2)
    h.add(make_request(1, 1, 3), make_request(2, 1, 3), make_request(3, 1, 3))
    plan, _ = h.step()
    assert [r.seq_id for r in plan.requests] == [1, 2]
    plan, _ = h.step()
    assert running_rows(plan) == [(1, 1, 1, []), (2, 1, 1, [])]
    assert [r.seq_id for r in h.s.waiting] == [3]
    h.run_until_idle()
    assert h.outputs == {1: [10, 11, 12], 2: [10, 11, 12], 3: [10, 11, 12]}


def test_max_num_seqs(make: Callable[..., Harness]) -> None:
    h = make(max_num_seqs=2)
    reqs = [make_request(i, 2, 2) for i in (1, 2, 3)]
    h.add(*reqs)
    plan, _ = h.step()
    assert [r.seq_id for r in plan.requests] == [1, 2]
    assert [r.seq_id for r in h.s.waiting] == [3]
    assert reqs[2].status == RequestStatus.WAITING
    plan, outcomes = h.step()
    assert [r.seq_id for r in plan.requests] == [1, 2]  # 3 waits: 2 running when planned
    assert [o.finished for o in outcomes] == [RequestStatus.FINISHED_LENGTH] * 2
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1, 2]
    assert new_rows(plan) == [(3, reqs[2].prompt_token_ids, [2], 0, 2)]
    h.run_until_idle()
    assert h.outputs == {1: [10, 11], 2: [10, 11], 3: [10, 11]}


def test_one_token_rule(make: Callable[..., Harness]) -> None:
    h = make(max_num_batched_tokens=4)
    a = make_request(1, 6, 2)
    h.add(a)
    plan = h.s.schedule()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0], 0, 4)]
    # Mid-prefill: whatever the engine sends is discarded.
    assert h.s.update(plan, [55], None) == []
    assert a.token_ids == a.prompt_token_ids
    plan = h.s.schedule()
    assert running_rows(plan) == [(1, 2, 4, [1])]
    with pytest.raises(AssertionError, match="no token for req-1"):
        h.s.update(plan, [-1], None)
    with pytest.raises(AssertionError, match="0 tokens for 1 requests"):
        h.s.update(plan, [], None)
    outcomes = h.s.update(plan, [55], [-0.5])
    assert [(o.token_id, o.logprob, o.finished) for o in outcomes] == [(55, -0.5, None)]
    assert a.token_ids == [*a.prompt_token_ids, 55]


# -- admission ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (make_request(1, 0, 4, prompt=[]), "prompt_token_ids is empty"),
        (
            make_request(1, 2, 4, prompt=[5, 100]),
            "prompt_token_ids contains 100, outside the vocabulary [0, 100)",
        ),
        (
            make_request(1, 2, 4, prompt=[-1, 5]),
            "prompt_token_ids contains -1, outside the vocabulary [0, 100)",
        ),
        (make_request(1, 2, 0), "max_tokens=0 must be >= 1"),
        (make_request(1, 2, -3), "max_tokens=-3 must be >= 1"),
        (
            make_request(1, 40, 25),
            "prompt (40 tokens) + max_tokens (25) = 65 exceeds max_model_len=64",
        ),
        (
            make_request(1, 20, 13),
            "prompt (20 tokens) + max_tokens (13) = 33 exceeds the KV cache's capacity of "
            "32 tokens (8 blocks x 4)",
        ),
    ],
)
def test_admission_invalid_argument(
    make: Callable[..., Harness], request_: Request, message: str
) -> None:
    h = make(num_blocks=8, max_model_len=64)
    with pytest.raises(AdmissionError) as err:
        h.add(request_)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.message == message
    assert str(err.value) == message
    assert h.s.requests == {} and list(h.s.waiting) == []


def test_admission_limits_are_inclusive(make: Callable[..., Harness]) -> None:
    h = make(num_blocks=8, max_model_len=40)
    h.add(make_request(1, 20, 12))  # exactly the KV capacity
    h.add(make_request(2, 1, 31))  # exactly the KV capacity
    h2 = make(num_blocks=16, max_model_len=40)
    h2.add(make_request(3, 30, 10))  # exactly max_model_len
    h2.add(make_request(4, 1, 1, prompt=[VOCAB - 1]))
    h2.run_until_idle()
    assert h2.outputs == {3: list(range(10, 20)), 4: [10]}


def test_admission_queue_full(make: Callable[..., Harness]) -> None:
    h = make(max_waiting=2)
    h.add(make_request(1, 2, 2), make_request(2, 2, 2))
    with pytest.raises(AdmissionError) as err:
        h.add(make_request(3, 2, 2))
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert "2 requests waiting (max_waiting=2)" in err.value.message
    assert "retry" in err.value.message
    assert sorted(h.s.requests) == [1, 2]
    # Once they run, the queue has room again.
    h.step()
    h.add(make_request(3, 2, 2))
    h.run_until_idle()
    assert sorted(h.outputs) == [1, 2, 3]


# -- stopping -----------------------------------------------------------------------------------


def test_stop_on_eos(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 3, 10)
    h.add(a)
    for _ in range(3):
        _, outcomes = h.step(eos_at(2))
    assert outcome_rows(outcomes) == [(1, EOS, RequestStatus.FINISHED_STOPPED)]
    assert a.token_ids == [*a.prompt_token_ids, 10, 11, EOS]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert h.s.counters.finish_reasons == {"stop": 1}


def test_ignore_eos_runs_to_max_tokens(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 3, 5, ignore_eos=True)
    h.add(a)
    for _ in range(5):
        h.step(eos_at(2))
    assert h.outputs == {1: [10, 11, EOS, 13, 14]}
    assert h.finished == {1: RequestStatus.FINISHED_LENGTH}


def test_stop_token_ids(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 3, 10, stop_token_ids=(42,))
    b = make_request(2, 3, 10)
    h.add(a, b)
    for _ in range(2):
        h.step(eos_at(1, token=42))
    assert h.outputs == {1: [10, 42], 2: [10, 42]}
    assert h.finished == {1: RequestStatus.FINISHED_STOPPED}
    assert b.status == RequestStatus.RUNNING


def test_stop_on_max_tokens(make: Callable[..., Harness]) -> None:
    h = make()
    h.add(make_request(1, 3, 1), make_request(2, 3, 4))
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11, 12, 13]}
    assert h.finished == {1: RequestStatus.FINISHED_LENGTH, 2: RequestStatus.FINISHED_LENGTH}


def test_stop_on_max_model_len(make: Callable[..., Harness]) -> None:
    h = make(max_model_len=64)
    a = make_request(1, 4, 20)
    h.add(a)
    h.s.max_model_len = 7  # e.g. a limit lowered after admission
    h.run_until_idle()
    assert h.outputs == {1: [10, 11, 12]}
    assert h.finished == {1: RequestStatus.FINISHED_LENGTH}
    assert a.num_tokens == 7


# -- prefix cache -------------------------------------------------------------------------------


def test_prefix_cache_hit_for_a_later_request(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 10, 1)
    h.add(a)
    plan, _ = h.step()
    assert new_rows(plan) == [(1, a.prompt_token_ids, [0, 1, 2], 0, 10)]
    assert a.num_cached_tokens == 0
    b = make_request(2, 10, 2, prompt=list(a.prompt_token_ids))
    h.add(b)
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert new_rows(plan) == [(2, a.prompt_token_ids, [0, 1, 3], 8, 2)]
    assert b.num_cached_tokens == 8
    assert h.s.counters.num_prefix_cache_hit_tokens == 8
    assert plan.num_scheduled_tokens == 2
    h.run_until_idle()
    assert h.outputs == {1: [10], 2: [10, 11]}


def test_prefix_cache_shared_with_a_running_request(make: Callable[..., Harness]) -> None:
    h = make()
    a = make_request(1, 10, 5)
    h.add(a)
    h.step()
    b = make_request(2, 13, 2, prompt=[*a.prompt_token_ids, 10, 5, 6])
    h.add(b)
    plan, _ = h.step()
    # a's first two blocks hit (its third, tokens 8..11, was not full when b was planned).
    assert new_rows(plan) == [(2, b.prompt_token_ids, [0, 1, 3, 4], 8, 5)]
    assert running_rows(plan) == [(1, 1, 10, [])]
    assert h.s.block_manager.ref_cnt[:5] == [2, 2, 1, 1, 1]
    h.run_until_idle()
    assert h.outputs == {1: [10, 11, 12, 13, 14], 2: [10, 11]}


def test_prefix_cache_disabled(make: Callable[..., Harness]) -> None:
    h = make(enable_prefix_caching=False)
    a = make_request(1, 10, 1)
    h.add(a)
    h.step()
    h.add(make_request(2, 10, 1, prompt=list(a.prompt_token_ids)))
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert new_rows(plan) == [(2, a.prompt_token_ids, [3, 4, 5], 0, 10)]
    assert h.s.block_manager.hash_to_block == {}
    assert h.s.requests == {}
