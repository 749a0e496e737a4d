"""The fair and priority policies and bounded preemption, driven by test_scheduler's fake engine
step: exact admission orders, victims, virtual token counters and refusal counts; the block
manager's integrity after every step and every scenario.

block_size is 4 throughout; virtual tokens cost 1 per prefill token and 2 per decode token (the
defaults) divided by the tenant's weight.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.policies import FairPolicy, FcfsPolicy, PriorityPolicy, StaticBatching
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from tests.scheduler_harness import BS, EOS, VOCAB, Harness, make_request, running_rows


def request(
    seq_id: int,
    num_prompt: int,
    max_tokens: int,
    tenant: str = "",
    *,
    weight: float = 1.0,
    priority: int = 0,
) -> Request:
    r = make_request(seq_id, num_prompt, max_tokens)
    r.tenant, r.tenant_weight, r.priority = tenant, weight, priority
    r.arrival_time = float(seq_id)  # arrival order = seq id order, whatever the clock says
    return r


@pytest.fixture
def make() -> Iterator[Callable[..., Harness]]:
    """A Harness whose scheduler has the given policy and config fields."""
    harnesses: list[Harness] = []

    def factory(
        policy: str,
        *,
        num_blocks: int = 16,
        max_model_len: int = 64,
        pipeline_parallel_size: int = 1,
        **config: Any,
    ) -> Harness:
        h = Harness(num_blocks=num_blocks, max_model_len=max_model_len)
        fields = {"max_num_batched_tokens": 64, "max_num_seqs": 8, "max_waiting": 128, **config}
        h.s = Scheduler(
            SchedulerConfig(scheduling_policy=policy, **fields),
            num_blocks,
            BS,
            max_model_len,
            VOCAB,
            (EOS,),
            pipeline_parallel_size=pipeline_parallel_size,
        )
        harnesses.append(h)
        return h

    yield factory
    for h in harnesses:
        h.check()
        if not h.s.has_work:
            h.s.block_manager.check_integrity([])
            assert h.s.block_manager.num_free_blocks == h.s.block_manager.num_blocks


def admitted(h: Harness) -> list[int]:
    """Seq ids in the order they were first admitted."""
    order: list[int] = []
    for plan in h.plans:
        order.extend(r.request.seq_id for r in plan.new_requests if r.request.seq_id not in order)
    return order


def outputs_ok(h: Harness, *requests: Request) -> None:
    """Each request streamed 10, 11, ... once each (nothing lost or repeated by a preemption)."""
    for r in requests:
        assert h.outputs[r.seq_id] == list(range(10, 10 + r.max_tokens)), r.request_id
        assert h.finished[r.seq_id] == RequestStatus.FINISHED_LENGTH


def test_policies_and_their_classes(make: Callable[..., Harness]) -> None:
    classes = {"continuous": FcfsPolicy, "fcfs": FcfsPolicy, "fair": FairPolicy}
    classes |= {"priority": PriorityPolicy, "static": StaticBatching}
    for policy, cls in classes.items():
        scheduler = make(policy).s
        assert type(scheduler) is Scheduler and type(scheduler.policy) is cls
        assert scheduler.policy.s is scheduler
    assert SchedulerConfig(scheduling_policy="continuous").policy == "fcfs"
    with pytest.raises(ValueError, match="max_preemptions=-1 must be >= 0"):
        SchedulerConfig(max_preemptions=-1)
    with pytest.raises(ValueError, match="preemption_grace_steps=-2 must be >= 0"):
        SchedulerConfig(preemption_grace_steps=-2)


# -- the fair policy: virtual token counters ----------------------------------------------------


def test_fair_admits_the_tenant_served_least(make: Callable[..., Harness]) -> None:
    """One seat: tenants take turns, whatever the arrival order; counters are exact. (A long
    grace keeps fair preemption out of it: admission order alone.)"""
    h = make("fair", max_num_seqs=1, preemption_grace_steps=100)
    a = [request(i, 4, 2, "a") for i in (1, 2, 3)]
    b = [request(i, 4, 2, "b") for i in (4, 5, 6)]
    h.add(*a, *b)
    h.run_until_idle()
    assert admitted(h) == [1, 4, 2, 5, 3, 6]
    # Per request: 4 prompt positions (prefill) + 1 output position fed back (decode, x2).
    for name in ("a", "b"):
        t = h.s.tenants[name]
        assert (t.virtual_tokens, t.num_prompt_tokens, t.num_decode_tokens) == (18.0, 12, 3)
        assert t.num_generated_tokens == 6
    outputs_ok(h, *a, *b)


def test_fcfs_keeps_arrival_order_and_counts_tenants_too(make: Callable[..., Harness]) -> None:
    h = make("fcfs", max_num_seqs=1)
    h.add(*(request(i, 4, 2, "a") for i in (1, 2, 3)), *(request(i, 4, 2, "b") for i in (4, 5)))
    h.run_until_idle()
    assert admitted(h) == [1, 2, 3, 4, 5]
    assert h.s.tenants["a"].virtual_tokens == 18.0 and h.s.tenants["b"].virtual_tokens == 12.0


def test_fair_weights_divide_the_charge(make: Callable[..., Harness]) -> None:
    """Weight 2 is charged half: a's two requests cost what b's one does."""
    h = make("fair", max_num_seqs=1)
    h.add(*(request(i, 4, 2, "a", weight=2.0) for i in (1, 2, 3, 4)))
    h.add(*(request(i, 4, 2, "b") for i in (5, 6)))
    h.run_until_idle()
    # a is first (tie, first in line); then a (3) < b (6), a (6) = b (6): a is first in line...
    assert admitted(h) == [1, 5, 2, 3, 6, 4]
    assert h.s.tenants["a"].virtual_tokens == 12.0 and h.s.tenants["b"].virtual_tokens == 12.0


def test_fair_lift_does_not_bank_idle_credit(make: Callable[..., Harness]) -> None:
    """b was idle while a ran: it comes back at a's counter, not at 0, so it does not lock a
    out; and a counter above the others' is kept (never lowered)."""
    h = make("fair", max_num_seqs=1)
    a1, a2, a3 = (request(i, 4, 4, "a") for i in (1, 2, 3))
    h.add(a1, a2, a3)
    for _ in range(2):
        h.step()
    counter_a = h.s.tenants["a"].virtual_tokens
    assert counter_a == 4.0 + 2.0  # a1's prompt, then one decode position
    b1, b2 = request(4, 4, 2, "b"), request(5, 4, 2, "b")
    h.add(b1, b2)
    assert h.s.tenants["b"].virtual_tokens == counter_a  # lifted to the least active counter
    h.run_until_idle()
    assert admitted(h) == [1, 4, 2, 5, 3]
    # Back after idling with a counter above a's: kept.
    h.s.tenants["b"].virtual_tokens = 1000.0
    h.add(request(6, 4, 2, "a"), request(7, 4, 2, "b"))
    assert h.s.tenants["b"].virtual_tokens == 1000.0
    h.run_until_idle()


def test_idle_tenants_are_forgotten_beyond_the_bound(make: Callable[..., Harness]) -> None:
    """Clients name tenants (`user`), so the ledger keeps at most max_idle idle ones, the longest
    idle forgotten first; a tenant with work is never forgotten, and one that returns is lifted
    as a new one is."""
    h = make("fair", max_num_seqs=2)
    h.s.tenants.max_idle = 2
    busy = request(1, 4, 40, "busy")
    h.add(busy)
    for i, name in enumerate(("u1", "u2", "u3"), start=2):
        h.add(request(i, 4, 2, name))
        while any(r.tenant == name for r in h.s.running + list(h.s.waiting)):
            h.step()
    assert set(h.s.tenants.tenants) == {"busy", "u2", "u3"}  # u1, idle longest, forgotten
    h.add(request(9, 4, 2, "u1"))
    assert h.s.tenants["u1"].virtual_tokens == h.s.tenants["busy"].virtual_tokens
    assert h.s.tenants["u1"].num_generated_tokens == 0
    h.run_until_idle()
    # u1 went idle (u2 forgotten), then busy did (u3 forgotten).
    assert set(h.s.tenants.tenants) == {"u1", "busy"}


def test_fair_is_work_conserving(make: Callable[..., Harness]) -> None:
    """A lone tenant gets every seat; an idle tenant's share goes to the busy one."""
    h = make("fair", max_num_seqs=4)
    h.add(*(request(i, 4, 6, "a") for i in range(1, 7)))
    plan, _ = h.step()
    assert [r.request.seq_id for r in plan.new_requests] == [1, 2, 3, 4]
    h.run_until_idle()
    assert h.s.counters.num_preemptions == 0


def run_backlogged(h: Harness, tenants: dict[str, float], n: int) -> dict[str, float]:
    """Every tenant sends n requests at once (8-token prompts, 12 tokens out); step until the
    first tenant has nothing waiting; return each tenant's weighted service then
    (prefill + 2 x decode tokens)."""
    seq_ids = iter(range(1, 10_000))
    for _ in range(n):
        for name, weight in tenants.items():
            h.add(request(next(seq_ids), 8, 12, name, weight=weight))
    while all(any(r.tenant == name for r in h.s.waiting) for name in tenants):
        h.step()
    ledger = h.s.tenants
    return {name: ledger[name].num_prompt_tokens + 2 * ledger[name].num_decode_tokens
            for name in tenants}  # fmt: skip


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0)])
def test_fair_service_under_contention_follows_the_weights(
    make: Callable[..., Harness], weights: tuple[float, float]
) -> None:
    h = make("fair", max_num_seqs=4, num_blocks=64, max_model_len=32)
    service = run_backlogged(h, {"a": weights[0], "b": weights[1]}, 40)
    ratio = service["a"] / service["b"]
    target = weights[0] / weights[1]
    assert abs(ratio / target - 1) < 0.10, (ratio, target, service)
    h.run_until_idle(max_steps=2000)


def test_fcfs_service_follows_arrival_not_weights(make: Callable[..., Harness]) -> None:
    """The same workload under fcfs, a's 40 requests first: b gets next to nothing."""
    h = make("fcfs", max_num_seqs=4, num_blocks=64, max_model_len=32)
    seq_ids = iter(range(1, 100))
    h.add(*(request(next(seq_ids), 8, 12, "a") for _ in range(40)))
    h.add(*(request(next(seq_ids), 8, 12, "b") for _ in range(40)))
    for _ in range(100):
        h.step()
    assert h.s.tenants["b"].num_prompt_tokens == 0
    h.run_until_idle(max_steps=2000)


def test_fair_preempts_the_most_served_tenant_for_a_waiting_one(
    make: Callable[..., Harness],
) -> None:
    """Two seats, both a's; b arrives. Once a's counter is ahead of b's by at least what b's
    request will be charged (its 8-token prefill), b takes the seat of a's latest admitted
    request (reason "fair")."""
    h = make("fair", max_num_seqs=2)
    a1, a2, a3 = (request(i, 4, 12, "a") for i in (1, 2, 3))
    h.add(a1, a2, a3)
    h.step()  # a1, a2 prefill: a = 8
    b1 = request(4, 8, 2, "b")
    h.add(b1)  # lifted to 8
    assert h.s.tenants["b"].virtual_tokens == 8.0
    h.step()  # a decodes two: a = 12; b needs a >= 8 + 8: not yet
    assert b1.status == RequestStatus.WAITING and h.s.counters.num_preemptions == 0
    plan, _ = h.step()  # a is at 16 once this step's decodes are charged: a2 gives b its seat
    assert plan.finished_seq_ids == [2]
    assert [r.request.seq_id for r in plan.new_requests] == [4]
    assert running_rows(plan) == [(1, 1, 5, [])]
    assert h.s.counters.num_preemptions_by_reason == {"fair": 1}
    assert a2.preemption.reason == "fair" and a2.num_preemptions == 1
    assert [r.seq_id for r in h.s.waiting] == [2, 3]  # a2 first of a's again
    h.run_until_idle()
    outputs_ok(h, a1, a2, a3, b1)


def test_fair_memory_preemption_picks_the_most_served_tenant(
    make: Callable[..., Harness],
) -> None:
    """Blocks run out: the victim is the latest of the tenant with the largest counter, not the
    newest request overall (fcfs would pick b1)."""
    h = make("fair", num_blocks=6, max_num_seqs=3)
    a1, a2 = request(1, 4, 12, "a"), request(2, 4, 12, "a")
    h.add(a1, a2)
    h.step()
    b1 = request(3, 4, 12, "b")
    h.add(b1)  # lifted to a's 8
    while not h.s.counters.num_preemptions:
        h.step()
    assert h.s.counters.num_preemptions_by_reason == {"memory": 1}
    assert a2.num_preemptions == 1 and b1.num_preemptions == 0
    h.run_until_idle()
    outputs_ok(h, a1, a2, b1)


# -- the priority policy ------------------------------------------------------------------------


def test_priority_orders_the_queue(make: Callable[..., Harness]) -> None:
    h = make("priority", max_num_seqs=1)
    h.add(request(1, 4, 2, priority=5), request(2, 4, 2, priority=1))
    h.add(request(3, 4, 2, priority=-3), request(4, 4, 2, priority=1))
    h.run_until_idle()
    assert admitted(h) == [3, 2, 4, 1]


def test_priority_preempts_lower_priority_for_a_seat(make: Callable[..., Harness]) -> None:
    """Two seats held by priority 5 and 3; a priority 0 request preempts the 5 (the highest
    value), not the 3, though the 3 was admitted later."""
    h = make("priority", max_num_seqs=2)
    low5, low3 = request(1, 4, 8, priority=5), request(2, 4, 8, priority=3)
    h.add(low5)
    h.step()
    h.add(low3)
    h.step()
    high = request(3, 4, 2, priority=0)
    h.add(high)
    plan, _ = h.step()
    assert plan.finished_seq_ids == [1]
    assert [r.request.seq_id for r in plan.new_requests] == [3]
    assert h.s.counters.num_preemptions_by_reason == {"priority": 1}
    # Equal priority never preempts: another priority-3 request waits for a seat.
    h.add(request(4, 4, 2, priority=3))
    h.step()
    assert h.s.counters.num_preemptions == 1
    h.run_until_idle()
    outputs_ok(h, low5, low3, high)


def test_priority_preempts_for_blocks(make: Callable[..., Harness]) -> None:
    """No blocks for the waiting priority 0 request: running low-priority ones give theirs, the
    latest of the highest value first, until it fits."""
    h = make("priority", num_blocks=4, max_num_seqs=4)
    lows = [request(i, 4, 4, priority=2) for i in (1, 2)]
    h.add(*lows)
    h.step()
    h.step()  # each holds 2 blocks now
    high = request(3, 8, 2, priority=0)  # needs 2 blocks
    h.add(high)
    plan, _ = h.step()
    assert plan.finished_seq_ids == [2]
    assert [r.request.seq_id for r in plan.new_requests] == [3]
    assert h.s.counters.num_preemptions_by_reason == {"priority": 1}
    h.run_until_idle()
    outputs_ok(h, *lows, high)


def test_priority_does_not_preempt_when_it_would_not_fit_anyway(
    make: Callable[..., Harness],
) -> None:
    """The waiting priority-1 request needs 3 blocks; the only lower-priority running request
    holds 1 and none is free: preempting it would waste its work and admit nobody, so it runs
    on."""
    h = make("priority", num_blocks=6, max_num_seqs=4)
    p0, p5 = request(1, 16, 4, priority=0), request(2, 2, 2, priority=5)
    h.add(p0, p5)
    h.step()  # p0 holds 4 blocks, p5 1; 1 free
    p1 = request(3, 12, 2, priority=1)
    h.add(p1)
    h.step()  # p0 takes the last free block for its decode
    assert h.s.counters.num_preemptions == 0 and p5.num_preemptions == 0
    assert p1.status == RequestStatus.WAITING
    h.run_until_idle()
    outputs_ok(h, p0, p5, p1)


def test_priority_memory_preemption_picks_the_lowest_priority(
    make: Callable[..., Harness],
) -> None:
    h = make("priority", num_blocks=5, max_num_seqs=3)
    p1, p9 = request(1, 4, 8, priority=1), request(2, 4, 8, priority=9)
    p4 = request(3, 4, 8, priority=4)
    h.add(p1, p9, p4)
    h.step()
    plan, _ = h.step()  # two of them need a second block, one is free: p9 goes
    assert plan.finished_seq_ids == [2]
    assert h.s.counters.num_preemptions_by_reason == {"memory": 1}
    h.run_until_idle()
    outputs_ok(h, p1, p9, p4)


# -- bounded preemption -------------------------------------------------------------------------


def test_max_preemptions_protects_a_request(make: Callable[..., Harness]) -> None:
    """Four blocks, three requests of one block each: a takes the last free block, b needs one.
    fcfs would preempt c (the newest), but c was preempted max_preemptions=1 times already: b,
    next in the walk, gives its own back, and the refusal is counted."""
    h = make("fcfs", num_blocks=4, max_preemptions=1)
    a, b, c = (request(i, 4, 8) for i in (1, 2, 3))
    h.add(a, b, c)
    h.step()
    c.num_preemptions = 1  # as if preempted once before
    plan, _ = h.step()
    assert plan.finished_seq_ids == [2]
    assert running_rows(plan) == [(1, 1, 4, [3]), (3, 1, 4, [1])]  # c takes b's block
    assert h.s.counters.num_preemptions_refused == 1
    h.run_until_idle()
    outputs_ok(h, a, b, c)
    assert c.num_preemptions == 1  # never chosen again
    assert h.s.counters.num_preemptions == sum(h.s.counters.num_preemptions_by_reason.values())


def test_grace_steps_protect_a_newly_admitted_request(make: Callable[..., Harness]) -> None:
    """Priority: a high-priority request waits rather than preempt one admitted fewer than
    preemption_grace_steps ago; once the grace is over, it preempts."""
    h = make("priority", max_num_seqs=1, preemption_grace_steps=3)
    low = request(1, 4, 8, priority=5)
    h.add(low)
    h.step()  # low admitted at step 1
    high = request(2, 4, 2, priority=0)
    h.add(high)
    h.step()  # step 2: 1 step since admission
    h.step()  # step 3: 2 steps
    assert high.status == RequestStatus.WAITING
    assert h.s.counters.num_preemptions_refused == 2
    plan, _ = h.step()  # step 4: 3 steps, grace over
    assert plan.finished_seq_ids == [1]
    assert [r.request.seq_id for r in plan.new_requests] == [2]
    h.run_until_idle()
    outputs_ok(h, low, high)


@pytest.mark.parametrize("policy", ["fcfs", "fair", "priority"])
def test_no_deadlock_when_every_candidate_is_protected(
    make: Callable[..., Harness], policy: str
) -> None:
    """Everyone protected (long grace), blocks short: a request that needs a block and finds
    only protected ones gives its own back; every request still finishes, once each."""
    h = make(policy, num_blocks=6, max_num_seqs=4, preemption_grace_steps=1000)
    reqs = [request(i, 4, 12, "ab"[i % 2], priority=i % 3) for i in range(1, 5)]
    h.add(*reqs)
    h.run_until_idle(max_steps=500)
    outputs_ok(h, *reqs)
    c = h.s.counters
    assert c.num_preemptions > 0 and c.num_preemptions_refused > 0
    assert c.num_preemptions == sum(c.num_preemptions_by_reason.values())


@pytest.mark.parametrize("policy", ["fair", "priority"])
def test_policies_with_overlap_and_pipeline_slots(
    make: Callable[..., Harness], policy: str
) -> None:
    """Fair and priority preemptions with two steps in flight, and with two pipeline slots:
    the same outputs, every block free after."""
    for slots in (1, 2):
        h = make(policy, num_blocks=10, max_num_seqs=3, pipeline_parallel_size=slots)
        reqs = [request(i, 5, 9, "abc"[i % 3], priority=-i) for i in range(1, 9)]
        h.add(*reqs[:4])
        h.plan()
        h.add(*reqs[4:])
        if slots == 1:
            h.run_overlapped()
        else:
            h.run_pipelined()
        outputs_ok(h, *reqs)
        assert h.s.counters.num_preemptions > 0


def test_list_and_find_requests(make: Callable[..., Harness]) -> None:
    h = make("fair", max_num_seqs=1)
    r1, r2 = request(1, 4, 2, "a", priority=3), request(2, 6, 2, "b")
    r1.request_id, r2.request_id = "cmpl-x-0", "cmpl-x-1"
    r3 = request(3, 4, 2, "b")
    r3.request_id = "cmpl-x-1x"
    h.add(r1, r2, r3)
    h.step()
    rows = h.s.list_requests()
    assert [(r.request_id, r.state, r.tenant, r.num_blocks) for r in rows] == [
        ("cmpl-x-0", "running", "a", 1),
        ("cmpl-x-1", "waiting", "b", 0),
        ("cmpl-x-1x", "waiting", "b", 0),
    ]
    assert [r.request_id for r in h.s.list_requests("b")] == ["cmpl-x-1", "cmpl-x-1x"]
    assert {r.seq_id for r in h.s.find("cmpl-x")} == {1, 2}
    assert {r.seq_id for r in h.s.find("cmpl-x-1x")} == {3}
    tenants = {t.tenant: t for t in h.s.tenant_rows()}
    a, b = tenants["a"], tenants["b"]
    assert (a.num_running, a.num_blocks, b.num_waiting) == (1, 1, 2)
    h.run_until_idle()


@pytest.mark.parametrize("weight_a", [1.0, 2.0])
def test_fair_seats_do_not_swing_between_backlogged_tenants(
    make: Callable[..., Harness], weight_a: float
) -> None:
    """Two tenants keep sending (each alone would fill the 16 seats): fair preemption brings the
    seats to their weighted shares and stops there, instead of swinging them from one tenant to
    the other (each swing a burst of preemptions and recomputes). Over the run, the weighted
    service follows the weights within 10%."""
    h = make(
        "fair",
        num_blocks=2048,
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        max_waiting=1024,
    )
    rng = random.Random(0)
    seq_ids = iter(range(1, 10_000))
    for _ in range(300):
        for name, weight in (("a", weight_a), ("b", 1.0)):
            if rng.random() < 0.4:
                h.add(request(next(seq_ids), 32, 64, name, weight=weight))
        h.step()
    assert h.s.counters.num_preemptions <= 20  # swinging: 166 with weights 1:1
    ledger = h.s.tenants
    service = {t: ledger[t].num_prompt_tokens + 2 * ledger[t].num_decode_tokens for t in "ab"}
    assert abs(service["a"] / service["b"] / weight_a - 1) < 0.10, service
    assert all(any(r.tenant == t for r in h.s.waiting) for t in "ab")  # backlogged throughout
    for r in list(h.s.requests):
        h.s.abort(r)


def test_preemption_and_tenant_metrics_are_labeled(make: Callable[..., Harness]) -> None:
    """The preemptions metric carries the reason, the tenant metrics the tenant (read from the
    same snapshot GetStats returns)."""
    from llmserve.scheduler.service.telemetry import SchedulerTelemetry

    h = make("fair", max_num_seqs=2)
    h.add(*(request(i, 4, 12, "a") for i in (1, 2, 3)))
    h.step()
    h.add(request(4, 8, 2, "b"))
    for _ in range(3):
        h.step()
    counters = h.s.counters
    snapshot = {
        "num_blocks": 16,
        "num_preemptions_by_reason": dict(counters.num_preemptions_by_reason),
        "num_preemptions_refused": counters.num_preemptions_refused,
        "tenants": h.s.tenant_rows(),
    }
    telemetry = SchedulerTelemetry(lambda: snapshot)
    assert telemetry._observe("num_preemptions") == [(1, {"reason": "fair"})]
    assert telemetry._observe("num_preemptions_refused") == [(0, {})]
    virtual = dict((attrs["tenant"], v) for v, attrs in telemetry._observe("tenant_virtual_tokens"))
    assert virtual == {"a": h.s.tenants["a"].virtual_tokens, "b": h.s.tenants["b"].virtual_tokens}
    tokens = {(a["tenant"], a["kind"]): v for v, a in telemetry._observe("tenant_tokens")}
    assert tokens[("b", "prompt")] == 8 and tokens[("a", "generated")] > 0
    h.run_until_idle()
