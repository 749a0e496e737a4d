"""The Scheduler driven by a fake engine step (shared by the scheduler tests): exact plans,
block ids and token streams.

block_size is 4 throughout. The fake engine samples token 10 + k as a request's k-th output, so
a token's value says which output it is: a re-emitted output shows up as a repeated value.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator

import pytest

from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.contract.mirror import Mirror
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import StepOutcome, StepPlan
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
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
        num_state_slots: int = 0,
        num_state_snapshot_slots: int = 0,
    ) -> None:
        config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_waiting=max_waiting,
            enable_prefix_caching=enable_prefix_caching,
            scheduling_policy=scheduling_policy,
            static_batch_wait_ms=static_batch_wait_ms,
        )
        self.s = Scheduler(
            config,
            num_blocks,
            BS,
            max_model_len,
            VOCAB,
            (EOS,),
            pipeline_parallel_size=pipeline_parallel_size,
            num_state_slots=num_state_slots,
            num_state_snapshot_slots=num_state_snapshot_slots,
        )
        self.outputs: dict[int, list[int]] = {}
        self.finished: dict[int, RequestStatus] = {}
        self.plans: list[StepPlan] = []
        self.last_tokens: list[int] = []
        self.num_blocks = num_blocks
        self.num_state_slots = num_state_slots
        self.num_state_snapshot_slots = num_state_snapshot_slots
        self.mirror = self._new_mirror() if mirror else None
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
            self.mirror = self._new_mirror()

    def _new_mirror(self) -> Mirror:
        return Mirror(
            BS, self.num_blocks, num_state_slots=self.num_state_slots,
            num_state_snapshot_slots=self.num_state_snapshot_slots,
        )  # fmt: skip

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


def eos_at(k: int, token: int = EOS) -> Callable[[Request], int]:
    def token_for(r: Request) -> int:
        return token if output_index(r) == k else position_token(r)

    return token_for


def random_workload(rng: random.Random) -> list[Request]:
    """Requests with shared prefixes (cache hits), of 1..14 prompt tokens, 1..9 outputs."""
    prefixes = [[rng.randrange(1, 90) for _ in range(8)] for _ in range(2)]
    requests = []
    for seq_id in range(1, rng.randrange(3, 9)):
        own = [rng.randrange(1, 90) for _ in range(rng.randrange(1, 7))]
        prompt = (rng.choice(prefixes)[: rng.randrange(0, 9)] + own)[:14]
        requests.append(make_request(seq_id, 0, rng.randrange(1, 10), prompt=prompt))
    return requests


def random_case(
    rng: random.Random, static_batching: bool = False
) -> tuple[dict[str, object], list[Request], Callable[[Request], int]]:
    """A random case for the step-at-a-time comparisons: the scheduler's limits (tight blocks
    and token budgets: chunked prefill and preemption; prefix caching most of the time; with
    static_batching, the static policy a quarter of the time), a random_workload, and the
    engine's tokens (each request's position token, EOS at a random output)."""
    config: dict[str, object] = {
        "num_blocks": rng.choice([6, 8, 16]),
        "max_num_batched_tokens": rng.choice([3, 5, 16, 64]),
        "max_num_seqs": rng.choice([2, 4, 8]),
        "enable_prefix_caching": rng.random() < 0.7,
    }
    if static_batching:
        config["scheduling_policy"] = "static" if rng.random() < 0.25 else "continuous"
    config["max_model_len"] = 24
    workload = random_workload(rng)
    eos_index = {r.seq_id: rng.randrange(0, 12) for r in workload}

    def token_for(r: Request) -> int:
        return EOS if output_index(r) == eos_index[r.seq_id] else position_token(r)

    return config, workload, token_for


def run_case(
    config: dict[str, object],
    workload: list[Request],
    token_for: Callable[[Request], int],
    drive: Callable[[Harness], None] | None = None,
    **extra: object,
) -> tuple[dict[int, list[int]], dict[int, RequestStatus]]:
    """The workload through a Harness (with the engine's Mirror) under config and extra; driven
    by drive, or (None) one step at a time; checked drained, with every block free and the
    state consistent; the outputs and finish reasons."""
    h = Harness(mirror=True, **config, **extra)  # type: ignore[arg-type]
    h.add(*[make_request(r.seq_id, 0, r.max_tokens, prompt=r.prompt_token_ids) for r in workload])
    if drive is not None:
        drive(h)
    else:
        for _ in range(1000):
            if not h.s.has_work:
                break
            h.plan(token_for)
            if h.in_flight:
                h.result()
    assert not h.s.has_work and h.s.block_manager.num_free_blocks == h.num_blocks
    h.check()
    return h.outputs, h.finished
