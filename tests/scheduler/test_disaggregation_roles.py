"""N prefill and M decode engines under one scheduler service (scheduler/disagg/roles.py),
torch-free: a real SchedulerService whose engine links are connected by hand (their EngineInfo
adopted, their results applied as a fake engine's) instead of over gRPC. Which prefill engine a
prompt goes to, which decode engine its KV moves to (prefix affinity, then load), the transfer ids
apart per decode engine, and each engine lost: its transfers given up, its requests moved to
an engine of the same role (else the other role), no block held anywhere after."""

from __future__ import annotations

import asyncio
from dataclasses import astuple

import pytest

from llmserve.protos import engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.disagg.roles import AFFINITY_SLACK, TRANSFER_ID_SHIFT
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.engine_link import EngineLink
from llmserve.scheduler.service.service import SchedulerService
from tests.factories import sampling

BS = 4
DECODES = ("127.0.0.1:1001", "127.0.0.1:1002")
PREFILLS = ("127.0.0.1:2001", "127.0.0.1:2002")


def connect(
    link: EngineLink, role: str, num_blocks: int = 32, num_host_blocks: int = 0
) -> Scheduler:
    """What the engine loop does on connecting: adopt the engine's info; the stream is open."""
    transfer_address = f"kv-{link.address}" if role == "decode" else ""
    info = engine_pb2.EngineInfo(
        model="m", num_blocks=num_blocks, block_size=BS, max_model_len=256, vocab_size=1000,
        eos_token_ids=[999], max_num_seqs=8, max_num_batched_tokens=64, engine_role=role,
        kv_transfer_address=transfer_address, kv_block_bytes=100,
        num_host_blocks=num_host_blocks,
    )  # fmt: skip
    link._on_engine_info(info)
    link.ready = link.been_ready = True  # what _set_ready does (its health update needs a loop)
    assert link.scheduler is not None
    return link.scheduler


@pytest.fixture
def service() -> SchedulerService:
    config = SchedulerConfig(engine_address=DECODES, prefill_engine_address=PREFILLS)
    s = SchedulerService(config)
    assert s.roles is not None
    for link in s.roles.decodes:
        connect(link, "decode")
    for link in s.roles.prefills:
        connect(link, "prefill")
    return s


def links(service: SchedulerService) -> tuple[list[EngineLink], list[EngineLink]]:
    assert service.roles is not None
    return service.roles.prefills, service.roles.decodes


def sched(link: EngineLink) -> Scheduler:
    assert link.scheduler is not None
    return link.scheduler


def request(seq_id: int, prompt: list[int], max_tokens: int = 3) -> Request:
    return Request(f"r{seq_id}", seq_id, prompt, sampling(), max_tokens, ignore_eos=True)


def submit(service: SchedulerService, req: Request) -> Scheduler:
    target = service._submit_target()
    assert target is not None
    target.add(req)
    return target


def step(link: EngineLink, token: int = 7, received: list[int] | None = None) -> None:
    """One step of link's engine: plan, a fake result, and what the engine loop does after."""
    s = sched(link)
    plan = s.schedule()
    s.update(plan, [token if row.samples else -1 for row in plan.rows])
    if received:
        s.handoffs.on_received(received)
    link.events.result_applied(link)
    s.check_integrity()


def run_prompts(prefill: EngineLink) -> None:
    while sched(prefill).running or sched(prefill).waiting:
        step(prefill)


def finish_all(service: SchedulerService) -> None:
    """Deliver every transfer and run every engine until nothing is left."""
    prefills, decodes = links(service)
    for _ in range(200):
        busy = False
        for link in [*prefills, *decodes]:
            s = sched(link)
            if s.has_work:
                busy = True
                step(link, received=list(s.transfers.in_flight))
        if not busy:
            return
    raise AssertionError("did not finish")


def assert_no_block_held(service: SchedulerService) -> None:
    for s in service.schedulers():
        s.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
        assert not s.block_manager.pins and not s.requests


def test_prompts_spread_over_the_prefill_engines_by_queued_tokens(
    service: SchedulerService,
) -> None:
    prefills, _ = links(service)
    long_one = submit(service, request(1, list(range(100, 140))))  # 40 tokens queued
    short = [submit(service, request(i, list(range(10 * i, 10 * i + 8)))) for i in (2, 3, 4)]
    assert long_one is sched(prefills[0])
    # 8, 16, 24 tokens queued on the second: all of them below the first's 40.
    assert all(s is sched(prefills[1]) for s in short)
    assert submit(service, request(5, [1] * 8)) is sched(prefills[1])  # 24 < 40
    assert submit(service, request(6, [2] * 8)) is sched(prefills[1])  # 32 < 40
    # 40 and 40: the fewer requests (1 against 5).
    assert submit(service, request(7, [3] * 8)) is sched(prefills[0])


def test_kv_moves_to_the_decode_engine_holding_the_prefix_unless_it_is_busier(
    service: SchedulerService,
) -> None:
    prefills, decodes = links(service)
    d0, d1 = sched(decodes[0]), sched(decodes[1])
    # Transfer ids apart per decode engine.
    assert next(d1.transfers.ids) >> TRANSFER_ID_SHIFT == service.roles.links.index(decodes[1])  # type: ignore[union-attr]
    system = list(range(500, 512))  # 3 full blocks shared
    d1.add(request(1, [*system, 1, 2, 3]))
    finish_all(service)
    assert d1.block_manager.find_cached_blocks(request(99, [*system, 9]))  # d1 holds it
    submit(service, request(2, [*system, 4, 5, 6, 7]))
    run_prompts(prefills[0])
    # Both idle: the prefix decides (not the order); only the block d1 lacks moves.
    ((tid, blocks, address),) = [astuple(s) for s in sched(prefills[0]).transfers.sends]
    assert address == f"kv-{DECODES[1]}" and len(blocks) == 1 and tid in d1.transfers.in_flight
    finish_all(service)
    # d1 busier than d0 by more than the slack: load wins over the prefix.
    for i in range(AFFINITY_SLACK + 1):
        d1.add(request(10 + i, [7, 7, 7, i]))
    submit(service, request(3, [*system, 8, 8, 8, 8]))
    run_prompts(prefills[0])
    ((tid, blocks, address),) = [astuple(s) for s in sched(prefills[0]).transfers.sends]
    assert address == f"kv-{DECODES[0]}" and len(blocks) == 4 and tid in d0.transfers.in_flight
    finish_all(service)
    assert_no_block_held(service)


def test_a_prefill_engine_lost_gives_up_its_transfers_and_moves_its_queue(
    service: SchedulerService,
) -> None:
    prefills, decodes = links(service)
    p0, p1 = prefills
    a, b = request(1, list(range(10, 22))), request(2, list(range(30, 42)))
    sched(p0).add(a)
    sched(p1).add(b)
    run_prompts(p0)
    run_prompts(p1)
    waiting = request(3, list(range(50, 58)))
    sched(p0).add(waiting)
    in_flight = {
        t.request.seq_id: t for d in decodes for t in sched(d).transfers.in_flight.values()
    }
    assert in_flight[1].source == PREFILLS[0] and in_flight[2].source == PREFILLS[1]
    # p0's engine is lost: what the engine loop does.
    p0.ready = False
    sched(p0).reset_engine()
    p0.events.engine_lost(p0)
    failed = sum(sched(d).transfers.counters.num_failed["prefill_lost"] for d in decodes)
    assert failed == 1  # a's only: b's comes from p1
    assert waiting in sched(p1).requests.values() and not sched(p0).requests
    finish_all(service)
    assert [r.num_output_tokens for r in (a, b, waiting)] == [3, 3, 3]
    assert_no_block_held(service)


def test_a_decode_engine_lost_moves_its_requests_to_the_other(service: SchedulerService) -> None:
    prefills, decodes = links(service)
    reqs = [request(i, list(range(10 * i, 10 * i + 9))) for i in (1, 2, 3, 4)]
    for r in reqs:
        submit(service, r)
    for p in prefills:
        run_prompts(p)
    for p in prefills:
        step(p)  # the sends go out
    lost = max(decodes, key=lambda d: len(sched(d).transfers.in_flight))
    other = decodes[1 - decodes.index(lost)]
    held = [t.request for t in sched(lost).transfers.in_flight.values()]
    assert held
    lost.ready = False
    sched(lost).reset_engine()
    lost.events.engine_lost(lost)
    assert not sched(lost).requests and all(r in sched(other).requests.values() for r in held)
    # New handoffs skip it while it is down.
    late = request(9, list(range(200, 209)))
    submit(service, late)
    for p in prefills:
        run_prompts(p)
    assert late.seq_id in sched(other).requests
    finish_all(service)
    assert all(r.num_output_tokens == 3 for r in [*reqs, late])
    assert_no_block_held(service)


def test_every_decode_engine_lost_the_prefill_engines_run_requests_whole(
    service: SchedulerService,
) -> None:
    prefills, decodes = links(service)
    for d in decodes:
        d.ready = False
        sched(d).reset_engine()
        d.events.engine_lost(d)
    assert all(sched(p).transfers.role == "both" for p in prefills)
    req = request(1, list(range(10, 19)))
    submit(service, req)
    finish_all(service)
    assert req.num_output_tokens == 3 and service.stats()["decode_ready"] is False
    # A decode engine back: prompts hand off again.
    connect(decodes[1], "decode")
    assert all(sched(p).transfers.role == "prefill" for p in prefills)
    assert_no_block_held(service)


def test_a_decode_engine_ready_after_the_prefill_engine_came_up_gets_the_prompts_kv() -> None:
    """The order a loaded machine gives: the decode engine's link adopts its engine (engine_up)
    but is not ready yet (it loads the configured adapters) when the prefill engine comes up,
    which then runs requests whole; once the decode engine is ready, prompts hand off again
    (seen in a fresh-clone CI run: a P/D stack that never moved any KV)."""
    config = SchedulerConfig(engine_address=DECODES[:1], prefill_engine_address=PREFILLS[:1])
    service = SchedulerService(config)
    prefills, decodes = links(service)
    connect(decodes[0], "decode")
    decodes[0].ready = False  # connected, its adapters still loading
    connect(prefills[0], "prefill")
    assert sched(prefills[0]).transfers.role == "both"

    async def ready() -> None:
        decodes[0]._set_ready(True)

    asyncio.run(ready())
    assert sched(prefills[0]).transfers.role == "prefill"
    req = request(1, list(range(10, 19)))
    assert submit(service, req) is sched(prefills[0])
    run_prompts(prefills[0])
    assert sched(decodes[0]).transfers.in_flight  # the KV moves instead of a whole run


def test_a_request_with_tokens_from_a_lost_prefill_engine_moves_to_a_decode_engine(
    service: SchedulerService,
) -> None:
    """A prefill engine that ran a request whole (no decode engine was up) and is lost after a
    decode engine came back: that request (its tokens streamed) goes to the decode engine, not
    to the other prefill engine, whose role is to stop at a first token."""
    prefills, decodes = links(service)
    for d in decodes:
        d.ready = False
        sched(d).reset_engine()
        d.events.engine_lost(d)
    req = request(1, list(range(10, 19)), max_tokens=6)
    home = next(p for p in prefills if sched(p) is submit(service, req))
    while req.num_output_tokens < 2:
        step(home)
    connect(decodes[0], "decode")  # back: prompts hand off again
    home.ready = False
    sched(home).reset_engine()
    home.events.engine_lost(home)
    assert req.seq_id in sched(decodes[0]).requests
    assert all(req.seq_id not in sched(p).requests for p in prefills)
    finish_all(service)
    assert req.num_output_tokens == 6
    assert_no_block_held(service)


def test_stats_sum_the_engines_and_list_each(service: SchedulerService) -> None:
    _, decodes = links(service)
    submit(service, request(1, list(range(10, 19))))
    sched(decodes[1]).add(request(2, [1, 2, 3]))
    stats = service.stats()
    assert stats["num_blocks"] == 64 and stats["prefill_num_blocks"] == 64
    assert stats["num_waiting"] == 2 and stats["prefill_num_waiting"] == 1
    rows = {row["address"]: row for row in stats["engines"]}
    assert [rows[a]["role"] for a in (*DECODES, *PREFILLS)] == ["decode"] * 2 + ["prefill"] * 2
    assert rows[DECODES[1]]["num_waiting"] == 1 and all(r["ready"] for r in rows.values())
    from llmserve.scheduler.service.convert import stats_to_proto

    msg = stats_to_proto(stats)
    assert [e.address for e in msg.engines] == [*DECODES, *PREFILLS]


def test_host_tiers_under_both_roles_bring_prompts_back_and_hold_nothing() -> None:
    """A host tier under each pool: the prefill pool (12 blocks) cannot hold 6 prompts of 3
    full blocks, so the second round's prefixes come back from its host tier (swap-ins)
    instead of being recomputed, and still move to the decode engines; nothing is held after."""
    config = SchedulerConfig(engine_address=DECODES[:1], prefill_engine_address=PREFILLS[:1])
    service = SchedulerService(config)
    prefills, decodes = links(service)
    connect(decodes[0], "decode", num_blocks=32, num_host_blocks=64)
    connect(prefills[0], "prefill", num_blocks=12, num_host_blocks=64)
    p = sched(prefills[0])
    prompts = [[100 * i + j for j in range(13)] for i in range(6)]
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            submit(service, request(10 * round_ + i, prompt))
            finish_all(service)
    offload = p.block_manager.offload
    assert offload is not None and offload.counters.num_swap_ins == 6
    assert service.stats()["kv_offload_hit_blocks"]["host"] >= 6 * 3
    assert p.counters.num_prefix_cache_hit_tokens == 6 * 12  # the second round's
    assert sched(decodes[0]).transfers.counters.num_done == 12 - 6  # round 2: decode had them
    assert_no_block_held(service)


def test_config_refuses_more_engines_without_prefill_engines() -> None:
    with pytest.raises(ValueError, match="replicas"):
        SchedulerConfig(engine_address=DECODES)
    with pytest.raises(ValueError, match="both a prefill and a decode"):
        SchedulerConfig(engine_address=DECODES, prefill_engine_address=DECODES[:1])
    with pytest.raises(ValueError, match="listed twice"):
        SchedulerConfig(engine_address=DECODES[:1], prefill_engine_address=PREFILLS[:1] * 2)


def test_serving_once_every_engine_has_been_up() -> None:
    """The scheduler reports SERVING only when every engine it was given has been up once (so
    the first requests find every engine), and then while any one is."""
    config = SchedulerConfig(engine_address=DECODES, prefill_engine_address=PREFILLS)
    service = SchedulerService(config)
    prefills, decodes = links(service)
    for link in [*decodes, prefills[0]]:
        connect(link, link.role)
    assert not service.serving
    connect(prefills[1], "prefill")
    assert service.serving
    for link in [*decodes, prefills[0]]:
        link.ready = False
    assert service.serving  # the one left takes requests whole
    prefills[1].ready = False
    assert not service.serving
