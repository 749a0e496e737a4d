"""Pipeline parallelism's slots (P steps in flight, each request in one slot's steps), and
constrained requests waiting for their grammar, driven by a fake engine step
(tests/scheduler_harness.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from llmserve.protos import engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request, RequestStatus
from tests.scheduler_harness import (
    BS,
    EOS,
    VOCAB,
    Harness,
    make_request,
    new_rows,
    outcome_rows,
    random_case,
    run_case,
    running_rows,
)

# -- pipeline parallelism: P steps in flight, each request in one slot's steps --------------------


@pytest.mark.parametrize("num_slots", [2, 3])
def test_pipeline_slots_take_turns_with_disjoint_requests(
    make: Callable[..., Harness], num_slots: int
) -> None:
    """2P requests of 4 outputs: each of the first P steps admits two (the cap is
    ceil(2P / P) = 2), so group g (requests 2g+1, 2g+2) holds slot (g + 1) % P; then the groups
    take turns, one step each, with P steps in flight sharing no request (Harness.plan checks),
    and nothing is ever planned on a pending token."""
    h = make(pipeline_parallel_size=num_slots, mirror=True)
    reqs = [make_request(i, 3, 4) for i in range(1, 2 * num_slots + 1)]
    h.add(*reqs)
    for _ in range(num_slots):
        h.plan()
    assert [r.pipeline.slot for r in reqs] == [(i // 2 + 1) % num_slots for i in range(len(reqs))]
    assert [(r.num_computed_tokens, r.num_pending_tokens) for r in reqs] == [(3, 1)] * len(reqs)
    h.run_pipelined()
    groups = [[2 * g + 1, 2 * g + 2] for g in range(num_slots)]
    steps = [(p.step_id, [r.seq_id for r in p.requests]) for p in h.plans]
    last = 4 * num_slots
    assert steps[:last] == [(s, groups[(s - 1) % num_slots]) for s in range(1, last + 1)]
    assert all(r.samples for p in h.plans for r in p.rows)
    # Each group's end travels alone: no slot has anything to run, each plan passes them all.
    assert [(p.step_id, p.finished_seq_ids, p.rows) for p in h.plans[last:]] == [
        (last + num_slots * (g + 1), groups[g], []) for g in range(num_slots)
    ]
    assert h.outputs == {r.seq_id: [10, 11, 12, 13] for r in reqs}
    assert h.s.counters.num_preemptions == 0


def test_pipeline_admission_balances_the_slots(make: Callable[..., Harness]) -> None:
    """A slot admits while it holds fewer than ceil(min(running + waiting, max_num_seqs) / P)
    requests; the rest wait for another slot's step."""
    h = make(pipeline_parallel_size=2, max_num_seqs=6)
    h.add(make_request(1, 3, 5))
    plan, _ = h.step()  # step 1, slot 1: ceil(1 / 2) = 1
    assert [r.seq_id for r in plan.requests] == [1]
    reqs = [make_request(i, 3, 5) for i in range(2, 7)]
    h.add(*reqs)
    plan, _ = h.step()  # step 2, slot 0: ceil((1 + 5) / 2) = 3, slot 0 holds none
    assert [r.request.seq_id for r in plan.new_requests] == [2, 3, 4]
    plan, _ = h.step()  # step 3, slot 1: cap 3, slot 1 holds request 1
    assert [r.request.seq_id for r in plan.new_requests] == [5, 6]
    assert [r.seq_id for r in plan.requests] == [5, 6, 1]
    slots = {r.seq_id: r.pipeline.slot for r in h.s.running}
    assert slots == {1: 1, 2: 0, 3: 0, 4: 0, 5: 1, 6: 1}
    h.run_until_idle()
    assert h.outputs == {i: [10, 11, 12, 13, 14] for i in range(1, 7)}

    # max_num_seqs bounds the cap: 10 waiting, 4 seats, 2 per slot (not 4 to the first).
    # Slot 0's requests end at once; slot 1 at its cap admits nobody although seats are
    # free, and slot 0 takes the next two at its own step.
    h = make(pipeline_parallel_size=2, max_num_seqs=4)
    h.add(*(make_request(i, 3, 1 if i in (3, 4) else 3) for i in range(1, 11)))
    plan, _ = h.step()  # step 1, slot 1
    assert [r.seq_id for r in plan.requests] == [1, 2]
    plan, outcomes = h.step()  # step 2, slot 0
    assert [r.seq_id for r in plan.requests] == [3, 4]
    assert [o.finished for o in outcomes] == [RequestStatus.FINISHED_LENGTH] * 2
    plan, _ = h.step()  # step 3, slot 1: min(2 + 6, 4) / 2 = 2, and it holds 2
    assert plan.finished_seq_ids == [3, 4] and [r.seq_id for r in plan.requests] == [1, 2]
    plan, _ = h.step()  # step 4, slot 0 holds none
    assert [r.seq_id for r in plan.requests] == [5, 6]
    h.run_until_idle()
    assert h.outputs == {i: [10] if i in (3, 4) else [10, 11, 12] for i in range(1, 11)}


def test_pipeline_request_in_flight_is_not_scheduled_again(make: Callable[..., Harness]) -> None:
    """A request with a step in flight waits for its result: a sampling row (its token is
    pending) and a prompt chunk (no token pending) alike. A slot with nothing to run is passed
    over, so an empty plan means nothing can run until a result comes."""
    h = make(pipeline_parallel_size=2, mirror=True, max_num_batched_tokens=4)
    a, b = make_request(1, 10, 2), make_request(2, 3, 2)
    h.add(a, b)
    plan = h.plan()  # step 1, slot 1: cap ceil(2 / 2) = 1: a's first chunk
    assert (plan.step_id, new_rows(plan)) == (1, [(1, a.prompt_token_ids, [0], 0, 4)])
    plan = h.plan()  # step 2, slot 0: b's whole prompt, sampling
    assert (plan.step_id, new_rows(plan)) == (2, [(2, b.prompt_token_ids, [1], 0, 3)])
    assert (b.num_computed_tokens, b.num_pending_tokens) == (3, 1)
    # Step 3 (a's slot: a in flight) and step 4 (b's: b in flight) would be empty.
    assert h.s.schedule().is_empty and h.s.next_step_id == 5
    assert h.result() == []  # step 1
    plan = h.plan()  # step 5, slot 1: a's second chunk
    assert (plan.step_id, running_rows(plan)) == (5, [(1, 4, 4, [2])])
    assert h.s.schedule().is_empty  # steps 6 and 7
    assert outcome_rows(h.result()) == [(2, 10, None)]  # step 2
    plan = h.plan()  # step 8, slot 0: b decodes its known token, no placeholder
    assert (plan.step_id, running_rows(plan)) == (8, [(2, 1, 3, [])])
    h.run_pipelined()
    assert h.outputs == {1: [10, 11], 2: [10, 11]}


def test_pipeline_preempted_request_gets_a_slot_again(make: Callable[..., Harness]) -> None:
    """b (slot 0) is preempted while its step is in flight, when a (slot 1) needs a block: b
    loses its slot and its token in flight; it is readmitted into the slot of the step that
    admits it, recomputed from its tokens, and nothing is streamed twice."""
    h = make(pipeline_parallel_size=2, num_blocks=4, max_num_seqs=2, mirror=True)
    a, b, c = make_request(1, 4, 8), make_request(2, 4, 8), make_request(3, 2, 1)
    h.add(a)
    h.plan()  # step 1, slot 1: a
    h.add(b, c)
    plan = h.plan()  # step 2, slot 0: ceil(min(1 + 2, 2) / 2) = 1: b, not c
    assert [r.seq_id for r in plan.requests] == [2] and [a.pipeline.slot, b.pipeline.slot] == [1, 0]
    while b.status == RequestStatus.RUNNING:
        h.result()
        plan = h.plan()
    assert (plan.step_id, plan.finished_seq_ids, running_rows(plan)) == (11, [2], [(1, 1, 8, [3])])
    assert (b.pipeline.slot, b.num_pending_tokens, b.block_table) == (None, 0, [])
    b_tokens = [*b.prompt_token_ids, 10, 11, 12, 13]
    assert b.token_ids == b_tokens and list(h.s.waiting) == [b, c]
    assert h.result() == []  # step 10: b's output 14, dropped
    h.run_pipelined()
    recompute = [p for p in h.plans if p.new_requests and p.new_requests[0].request is b][-1]
    # a alone runs in every other step of its slot (the ones between: b does not fit yet).
    assert [p.step_id for p in h.plans if a in p.requests] == [1, 3, 5, 7, 9, 11, 15, 19]
    assert (recompute.step_id, recompute.finished_seq_ids) == (22, [1])  # once a is done
    assert recompute.new_requests[0].token_ids == b_tokens
    assert [(p.step_id, [r.request.seq_id for r in p.new_requests]) for p in h.plans[-7:-5]] == [
        (22, [2]),  # slot 0
        (23, [3]),  # slot 1: ceil(min(1 + 1, 2) / 2) = 1 each
    ]
    assert h.outputs == {1: list(range(10, 18)), 2: list(range(10, 18)), 3: [10]}
    assert b.num_preemptions == 1 and h.s.counters.num_preemptions == 1


def test_pipeline_engine_reset_with_steps_in_flight(make: Callable[..., Harness]) -> None:
    """The engine dies with P = 3 steps in flight: every request loses its slot and its pending
    token; their results never come, and the steps after the reset need none of them."""
    h = make(pipeline_parallel_size=3, mirror=True)
    reqs = [make_request(i, 3 + i, 5) for i in range(1, 7)]
    h.add(*reqs)
    h.plan()
    h.plan()
    h.plan()
    h.result()  # step 1
    h.plan()  # step 4: requests 1 and 2 again
    assert len(h.in_flight) == 3 and [r.num_output_tokens for r in reqs] == [1, 1, 0, 0, 0, 0]
    h.reset_engine()
    assert h.s.last_result_step_id == 4
    assert list(h.s.waiting) == reqs
    assert all(r.pipeline.slot is None and r.num_pending_tokens == 0 for r in reqs)
    plan = h.plan()  # step 5, slot 2: cap ceil(6 / 3) = 2
    assert (plan.step_id, [r.request.seq_id for r in plan.new_requests]) == (5, [1, 2])
    assert plan.new_requests[0].token_ids == [*reqs[0].prompt_token_ids, 10]
    h.run_pipelined()
    assert h.outputs == {i: list(range(10, 15)) for i in range(1, 7)}


def test_pipeline_size_is_checked(make: Callable[..., Harness]) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size=0 must be >= 1"):
        make(pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="'static' does not support pipeline parallelism"):
        make(pipeline_parallel_size=2, scheduling_policy="static")
    h = make()
    h.add(make_request(1, 3, 2))
    h.step()
    with pytest.raises(AssertionError, match="changed with running requests"):
        h.s.set_pipeline_parallel_size(2)
    h.s.reset_engine()
    h.s.set_pipeline_parallel_size(2)  # as the service does for a restarted engine
    h.run_pipelined()
    assert h.outputs == {1: [10, 11]}


def test_pipeline_size_comes_from_the_engine_info() -> None:
    """The service adopts the engine's pipeline_parallel_size (0, from an engine older than the
    field, is 1), a restarted engine's too; static batching refuses P > 1 as a mismatch."""
    asyncio.run(_adopt_pipeline_sizes())


async def _adopt_pipeline_sizes() -> None:
    from llmserve.engine.contract.contract import EngineInfo
    from llmserve.engine.contract.convert import info_to_proto
    from llmserve.scheduler.service.engine_link import EngineMismatch
    from llmserve.scheduler.service.service import SchedulerService

    def info(**sizes: int) -> engine_pb2.EngineInfo:
        return info_to_proto(
            EngineInfo("m", VOCAB, 64, (EOS,), BS, 16, "cpu", "none", 4, 64, **sizes)
        )

    old = info()
    old.pipeline_parallel_size = 0
    service = SchedulerService(SchedulerConfig())
    service.link._on_engine_info(old)
    assert service.scheduler is not None and service.scheduler.pipeline_parallel_size == 1
    service.scheduler.reset_engine()
    new = info(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert (new.tensor_parallel_size, new.pipeline_parallel_size) == (2, 3)
    service.link._on_engine_info(new)
    assert service.scheduler.pipeline_parallel_size == 3
    static = SchedulerService(SchedulerConfig(scheduling_policy="static"))
    with pytest.raises(EngineMismatch, match="engine's pipeline_parallel_size=2"):
        static.link._on_engine_info(info(pipeline_parallel_size=2))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("num_slots", [2, 3])
def test_pipeline_gives_the_same_outputs_as_one_step_at_a_time(num_slots: int, seed: int) -> None:
    """Random workloads under random limits (continuous batching): P steps in flight change no
    output and no finish reason, no two steps in flight share a request, the Mirror accepts
    every plan and the block manager and slots are consistent after every step."""
    config, workload, token_for = random_case(random.Random(seed))
    one_at_a_time = run_case(config, workload, token_for)
    pipelined = run_case(
        config,
        workload,
        token_for,
        lambda h: h.run_pipelined(token_for, max_steps=2000),
        pipeline_parallel_size=num_slots,
    )
    assert one_at_a_time == pipelined


def test_constrained_request_waits_for_its_grammar(make: Callable[..., Harness]) -> None:
    """A constrained request is held out of the line until a result reports its grammar
    compiled: its constraint goes in one plan, plans keep asking while nothing else runs, an
    abort while held ends it, the same constraint later skips the wait, and an engine reset
    holds and lists it again (a resize rehashes it like any waiting request)."""
    from llmserve.protos.common_pb2 import StructuredOutput

    h = make(num_blocks=16)
    s = h.s

    def constrained(seq_id: int) -> Request:
        r = make_request(seq_id, 5, 3)
        r.sampling.structured_output.CopyFrom(StructuredOutput(regex="[a-z]+"))
        return r

    a, b = constrained(1), constrained(2)
    s.add(a)
    s.add(b)
    assert s.num_waiting == 2 and not s.waiting
    plan = s.schedule()
    assert plan.grammar_compiles == [a, b] and not plan.rows and not plan.is_empty
    asking = s.schedule()  # nothing to run: the plan only asks
    assert asking.grammar_compiles == [] and asking.asks_grammars and not asking.is_empty
    s.abort(b.seq_id)
    s.grammars_compiled([a.seq_id, b.seq_id])  # b ended meanwhile: ignored
    assert list(s.waiting) == [a] and not s.grammar_wait.held
    assert [r.request for r in s.schedule().rows] == [a]
    c = constrained(3)
    s.add(c)  # the same constraint, compiled already: straight into the line
    assert list(s.waiting) == [c]
    s.reset_engine()  # a new engine compiled nothing: both wait for it again
    assert not s.waiting and set(s.grammar_wait.held) == {1, 3}
    assert a.block_hashes  # hashed when admitted: a new block size rehashes held ones too
    assert s.resize(16, 2) == [] and a.block_hashes == []
    assert {r.seq_id for r in s.schedule().grammar_compiles} == {1, 3}
