"""The Scheduler driven by a fake engine step: exact plans, block ids and token streams.

block_size is 4 throughout. The fake engine samples token 10 + k as a request's k-th output, so
a token's value says which output it is: a re-emitted output shows up as a repeated value.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Iterator

import pytest

from llmserve.engine.convert import plan_from_proto
from llmserve.engine.mirror import Mirror
from llmserve.protos import engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.service.convert import plan_to_proto
from llmserve.scheduler.plan import StepOutcome, StepPlan
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import AdmissionError
from llmserve.scheduler.policies.static_batching import make_scheduler
from tests.factories import sampling

BS = 4
VOCAB = 100
EOS = 99


def make_request(
    seq_id: int,
    num_prompt: int,
    max_tokens: int,
    *,
    prompt: list[int] | None = None,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
) -> Request:
    """A request whose prompt starts with a token unique to seq_id (so no accidental cache hits)."""
    if prompt is None:
        prompt = [(seq_id * 7 + i) % 90 + 1 for i in range(num_prompt)]
    return Request(
        f"req-{seq_id}",
        seq_id,
        prompt,
        sampling(),
        max_tokens,
        stop_token_ids=frozenset(stop_token_ids),
        ignore_eos=ignore_eos,
    )


def output_index(request: Request) -> int:
    """Right after planning a step that samples for request: the index of the output token that
    step produces (its pending tokens, this one included, come after the known outputs)."""
    return request.num_output_tokens + request.num_pending_tokens - 1


def position_token(request: Request) -> int:
    return 10 + output_index(request)


class Harness:
    """A scheduler plus a fake engine applying the one token rule, recording every outcome.

    With mirror=True every plan also goes through the real contract (protobuf both ways) into
    the engine's Mirror, which checks each delta and applies the engine's one token rule when the
    step is planned, as an engine that runs steps in order does."""

    def __init__(
        self,
        *,
        num_blocks: int = 16,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        max_waiting: int = 16,
        max_model_len: int = 64,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "continuous",
        static_batch_wait_ms: float = 0.0,
        mirror: bool = False,
        pipeline_parallel_size: int = 1,
    ) -> None:
        config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_waiting=max_waiting,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
            static_batch_wait_ms=static_batch_wait_ms,
        )
        self.s = make_scheduler(
            config,
            num_blocks,
            BS,
            max_model_len,
            VOCAB,
            (EOS,),
            pipeline_parallel_size=pipeline_parallel_size,
        )
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, RequestStatus] = {}
        self.plans: list[StepPlan] = []
        self.last_tokens: list[int] = []
        self.num_blocks = num_blocks
        self.mirror = Mirror(BS, num_blocks) if mirror else None
        # Overlap: planned steps whose results are not applied yet, oldest first.
        self.in_flight: deque[tuple[StepPlan, list[int]]] = deque()

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.s.add(r)

    def check(self) -> None:
        self.s.check_integrity()

    def tokens_for(
        self, plan: StepPlan, token_for: Callable[[Request], int] = position_token
    ) -> list[int]:
        return [token_for(r.request) if r.samples else -1 for r in plan.rows]

    def finish_step(self, plan: StepPlan, tokens: list[int]) -> list[StepOutcome]:
        outcomes = self.s.update(plan, tokens, None)
        for o in outcomes:
            seq_id = o.request.seq_id
            assert seq_id not in self.finished, f"outcome for {seq_id} after it finished"
            self.outputs.setdefault(seq_id, []).append(o.token_id)
            if o.finished is not None:
                self.finished[seq_id] = o.finished
        self.check()
        return outcomes

    def step(
        self, token_for: Callable[[Request], int] = position_token
    ) -> tuple[StepPlan, list[StepOutcome]]:
        plan = self.s.schedule()
        self.plans.append(plan)
        self.check()
        self.last_tokens = self.tokens_for(plan, token_for)
        return plan, self.finish_step(plan, self.last_tokens)

    def run_until_idle(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.s.has_work:
                return
            self.step()
        raise AssertionError("scheduler did not go idle")

    # -- overlap: plan step N+1 before applying step N's result ----------------------------------

    def plan(self, token_for: Callable[[Request], int] = position_token) -> StepPlan:
        """Plan a step and put it in flight (empty plans are never sent). With pipeline
        parallelism, check that it shares no request with a step in flight."""
        plan = self.s.schedule()
        self.check()
        if plan.is_empty:
            return plan
        if self.s.pipeline_parallel_size > 1:
            held = {r.seq_id for p, _ in self.in_flight for r in p.requests}
            shared = held.intersection(r.seq_id for r in plan.requests)
            assert not shared, f"step {plan.step_id} shares {shared} with a step in flight"
        self.plans.append(plan)
        tokens = self.tokens_for(plan, token_for)
        self._engine_step(plan, tokens)
        self.in_flight.append((plan, tokens))
        return plan

    def result(self) -> list[StepOutcome]:
        """Apply the oldest step in flight's result."""
        plan, tokens = self.in_flight.popleft()
        return self.finish_step(plan, tokens)

    def _engine_step(self, plan: StepPlan, tokens: list[int]) -> None:
        if self.mirror is None:
            return
        batch = self.mirror.apply(plan_from_proto(plan_to_proto(plan)))
        assert [r.samples for r in batch.rows] == [r.samples for r in plan.rows]
        self.mirror.commit(batch, tokens)

    def reset_engine(self) -> None:
        """The engine restarts: steps in flight are lost, the mirror starts empty."""
        self.in_flight.clear()
        self.s.reset_engine()
        if self.mirror is not None:
            self.mirror = Mirror(BS, self.num_blocks)

    def run_overlapped(
        self, token_for: Callable[[Request], int] = position_token, max_steps: int = 300
    ) -> None:
        """The service's loop with two steps in flight: plan N+1, then apply N's result."""
        for _ in range(max_steps):
            if not self.s.has_work and not self.in_flight:
                return
            plan = self.plan(token_for)
            if len(self.in_flight) == 2 or (plan.is_empty and self.in_flight):
                self.result()
        raise AssertionError("scheduler did not go idle")

    def run_pipelined(
        self, token_for: Callable[[Request], int] = position_token, max_steps: int = 300
    ) -> None:
        """The service's loop for an engine of P pipeline stages: up to max(2, P) steps in
        flight; plan while there is room and work, else apply the oldest step's result."""
        depth = max(2, self.s.pipeline_parallel_size)
        for _ in range(max_steps):
            if not self.s.has_work and not self.in_flight:
                return
            has_room = len(self.in_flight) < depth and self.s.has_work
            if has_room and not self.plan(token_for).is_empty:
                continue
            assert self.in_flight, "work left, none of it plannable, nothing in flight: a hang"
            self.result()
        raise AssertionError("scheduler did not go idle")


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    harnesses: list[Harness] = []

    def factory(**kwargs: object) -> Harness:
        h = Harness(**kwargs)  # type: ignore[arg-type]
        harnesses.append(h)
        return h

    yield factory
    for h in harnesses:
        h.check()


def new_rows(plan: StepPlan) -> list[tuple[int, list[int], list[int], int, int]]:
    return [
        (
            r.request.seq_id,
            r.token_ids,
            r.block_table,
            r.num_computed_tokens,
            r.num_scheduled_tokens,
        )
        for r in plan.new_requests
    ]


def running_rows(plan: StepPlan) -> list[tuple[int, int, int, list[int]]]:
    return [
        (r.request.seq_id, r.num_scheduled_tokens, r.num_computed_tokens, r.new_block_ids)
        for r in plan.running
    ]


def outcome_rows(outcomes: list[StepOutcome]) -> list[tuple[int, int, RequestStatus | None]]:
    return [(o.request.seq_id, o.token_id, o.finished) for o in outcomes]


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


def eos_at(k: int, token: int = EOS) -> Callable[[Request], int]:
    def token_for(r: Request) -> int:
        return token if output_index(r) == k else position_token(r)

    return token_for


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
    assert h.s.padding == {1: length} and h.s.running == [a, b]

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
    assert h.s.running == [] and h.s.padding == {}
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
    assert h.s.batch_pending == set() and list(h.s.waiting) == [b]
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
    assert h.s.running == [b] and h.s.padding == {}
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
    assert h.s.padding == {1: RequestStatus.FINISHED_LENGTH}
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


def _random_workload(rng: random.Random) -> list[Request]:
    """Requests with shared prefixes (cache hits), of 1..14 prompt tokens, 1..9 outputs."""
    prefixes = [[rng.randrange(1, 90) for _ in range(8)] for _ in range(2)]
    requests = []
    for seq_id in range(1, rng.randrange(3, 9)):
        own = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 7))]
        prompt = (rng.choice(prefixes)[: rng.randrange(0, 9)] + own)[:14]
        requests.append(make_request(seq_id, 0, rng.randrange(1, 10), prompt=prompt))
    return requests


@pytest.mark.parametrize("seed", range(40))
def test_overlap_gives_the_same_outputs_as_one_step_at_a_time(seed: int) -> None:
    """Random workloads under random limits (chunked prefill, preemption, prefix caching, static
    batching, EOS at random outputs): planning ahead changes no output and no finish reason, the
    engine's Mirror accepts every plan, and the block manager is consistent after every step."""
    rng = random.Random(seed)
    config = {
        "num_blocks": rng.choice([6, 8, 16]),
        "max_num_batched_tokens": rng.choice([3, 5, 16, 64]),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "enable_prefix_caching": rng.random() < 0.7,
        "scheduling_policy": "static" if rng.random() < 0.25 else "continuous",
        "max_model_len": 24,
    }
    workload = _random_workload(rng)
    eos_index = {r.seq_id: rng.randrange(0, 12) for r in workload}

    def token_for(r: Request) -> int:
        return EOS if output_index(r) == eos_index[r.seq_id] else position_token(r)

    runs = []
    for overlap in (False, True):
        h = Harness(mirror=True, **config)  # type: ignore[arg-type]
        h.add(
            *[make_request(r.seq_id, 0, r.max_tokens, prompt=r.prompt_token_ids) for r in workload]
        )
        if overlap:
            h.run_overlapped(token_for, max_steps=1000)
        else:
            for _ in range(1000):
                if not h.s.has_work:
                    break
                h.plan(token_for)
                if h.in_flight:
                    h.result()
        assert not h.s.has_work and h.s.block_manager.num_free_blocks == h.num_blocks
        h.check()
        runs.append((h.outputs, h.finished))
    assert runs[0] == runs[1]


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
    from llmserve.engine.contract import EngineInfo
    from llmserve.engine.convert import info_to_proto
    from llmserve.scheduler.service.engine_link import EngineMismatch
    from llmserve.scheduler.service.service import SchedulerService

    def info(**sizes: int) -> engine_pb2.EngineInfo:
        return info_to_proto(
            EngineInfo("m", VOCAB, 64, (EOS,), BS, 16, "cpu", "none", 4, 64, **sizes)
        )

    old = info()
    old.pipeline_parallel_size = 0
    service = SchedulerService(SchedulerConfig())
    service._on_engine_info(old)
    assert service.scheduler is not None and service.scheduler.pipeline_parallel_size == 1
    service.scheduler.reset_engine()
    new = info(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert (new.tensor_parallel_size, new.pipeline_parallel_size) == (2, 3)
    service._on_engine_info(new)
    assert service.scheduler.pipeline_parallel_size == 3
    static = SchedulerService(SchedulerConfig(scheduling_policy="static"))
    with pytest.raises(EngineMismatch, match="engine's pipeline_parallel_size=2"):
        static._on_engine_info(info(pipeline_parallel_size=2))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("num_slots", [2, 3])
def test_pipeline_gives_the_same_outputs_as_one_step_at_a_time(num_slots: int, seed: int) -> None:
    """Random workloads under random limits (continuous batching): P steps in flight change no
    output and no finish reason, no two steps in flight share a request, the Mirror accepts
    every plan and the block manager and slots are consistent after every step."""
    rng = random.Random(seed)
    config = {
        "num_blocks": rng.choice([6, 8, 16]),
        "max_num_batched_tokens": rng.choice([3, 5, 16, 64]),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "enable_prefix_caching": rng.random() < 0.7,
        "max_model_len": 24,
    }
    workload = _random_workload(rng)
    eos_index = {r.seq_id: rng.randrange(0, 12) for r in workload}

    def token_for(r: Request) -> int:
        return EOS if output_index(r) == eos_index[r.seq_id] else position_token(r)

    runs = []
    for size in (1, num_slots):
        h = Harness(mirror=True, pipeline_parallel_size=size, **config)  # type: ignore[arg-type]
        h.add(
            *[make_request(r.seq_id, 0, r.max_tokens, prompt=r.prompt_token_ids) for r in workload]
        )
        if size == 1:
            for _ in range(1000):  # one step at a time
                if not h.s.has_work:
                    break
                h.plan(token_for)
                if h.in_flight:
                    h.result()
        else:
            h.run_pipelined(token_for, max_steps=2000)
        assert not h.s.has_work and h.s.block_manager.num_free_blocks == h.num_blocks
        h.check()
        runs.append((h.outputs, h.finished))
    assert runs[0] == runs[1]


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
