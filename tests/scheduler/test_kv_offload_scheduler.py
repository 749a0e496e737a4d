"""KV offload as the scheduler plans it (torch-free): evicted blocks copied down a tier, lower-tier
prefix hits copied back before their request is admitted, LRU at each tier, the copies in the
plan in the order the engine runs them, and the prefix hit rate a host tier buys on a workload
that thrashes the device pool."""

from __future__ import annotations

import pytest

from llmserve.common.step_plan import KV_TIERS, BlockCopies
from llmserve.protos import engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.kv_offload import DEVICE, DISK, HOST, KVOffload
from llmserve.scheduler.plan import StepPlan
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import sampling

BS = 4
PREFIX_BLOCKS = 4
NUM_PREFIXES = 16


def make(num_blocks: int, num_host: int = 0, num_disk: int = 0, **config: object) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=4, **config)  # type: ignore[arg-type]
    return Scheduler(
        cfg, num_blocks, BS, 256, 1000, (999,), num_host_blocks=num_host, num_disk_blocks=num_disk
    )


def request(seq_id: int, prompt: list[int], max_tokens: int = 2) -> Request:
    return Request(f"r{seq_id}", seq_id, prompt, sampling(), max_tokens, ignore_eos=True)


def prefix(i: int) -> list[int]:
    """Shared prefix i: PREFIX_BLOCKS full blocks, its tokens unique to i."""
    return [100 + i * 20 + j for j in range(PREFIX_BLOCKS * BS)]


def step(s: Scheduler) -> StepPlan:
    """Plan a step, send it through the contract, and apply the fake engine's tokens."""
    plan = s.schedule()
    plan_to_proto(plan)
    s.update(plan, [7 if row.samples else -1 for row in plan.rows])
    s.check_integrity()
    return plan


def run(s: Scheduler, *requests: Request, max_steps: int = 500) -> list[StepPlan]:
    for r in requests:
        s.add(r)
    plans = []
    for _ in range(max_steps):
        if not s.has_work:
            return plans
        plans.append(step(s))
    raise AssertionError("did not go idle")


TIER_NAMES = {value: name for name, value in KV_TIERS.items()}


def named(c: BlockCopies) -> tuple[str, str, list[int], list[int]]:
    """A batch of copies with its tiers by the scheduler's names."""
    return (TIER_NAMES[c.src_tier], TIER_NAMES[c.dst_tier], c.src_ids, c.dst_ids)


def copies(plans: list[StepPlan]) -> list[tuple[str, str, list[int], list[int]]]:
    return [named(c) for p in plans for c in p.kv_copies]


def test_evicted_block_goes_to_the_host_tier_and_comes_back() -> None:
    """Device pool of 6 blocks: A's two cached blocks are evicted by B (copied down, ids
    exact); A's prompt again finds them on the host: one plan brings them back (admitting
    nobody), the next admits it with them as prefix hits."""
    s = make(num_blocks=6, num_host=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # 2 full blocks + 1 token
    run(s, request(1, a, max_tokens=1))
    assert s.block_manager.free_blocks.keys() == {0, 1, 2, 3, 4, 5}
    # B takes all 6 blocks: 3, 4, 5 (never cached) first, then 2 (A's partial), 1, 0 (A's
    # full blocks, last first: copied to host slots 0 and 1).
    plans = run(s, request(2, list(range(20, 43)), max_tokens=1))
    assert copies(plans) == [(DEVICE, HOST, [1, 0], [0, 1])]
    # B freed its blocks last first: 0, 1 are reused first. A's prefix comes back into them
    # from slots 1, 0 while B's cached block 1 goes down to slot 2 (its block 0 holds a
    # partial block: nothing to keep); nobody is admitted.
    plans = run(s, request(3, [*a[:8], 50, 51], max_tokens=1))
    swap_plan, admit_plan = plans[0], plans[1]
    assert not swap_plan.new_requests
    assert copies([swap_plan]) == [(DEVICE, HOST, [1], [2]), (HOST, DEVICE, [1, 0], [0, 1])]
    (row,) = admit_plan.new_requests
    assert row.num_computed_tokens == 8 and row.block_table[:2] == [0, 1]
    offload = s.block_manager.offload
    assert offload is not None
    assert offload.counters.hit_blocks[HOST] == 2 and offload.counters.num_swap_ins == 1
    assert s.counters.num_prefix_cache_hit_tokens == 8


def test_copies_travel_in_the_engines_order_with_tiers_on_the_wire() -> None:
    offload = KVOffload(num_host_blocks=1, num_disk_blocks=1)
    keys = [(h, 0, (h,)) for h in (11, 12)]
    offload.store(5, keys[0])  # host slot 0
    offload.take_copies()
    offload.store(6, keys[1])  # host full: key 0 to disk, key 1 into its slot
    offload.bring_back(offload.find([keys[1]])[0], 9)
    batches = offload.take_copies()
    assert list(map(named, batches)) == [
        (HOST, DISK, [0], [0]), (DEVICE, HOST, [6], [0]), (HOST, DEVICE, [0], [9])
    ]  # fmt: skip
    plan = StepPlan(1, [], kv_copies=batches)
    msg = plan_to_proto(plan)
    assert [(c.src_tier, c.dst_tier) for c in msg.kv_copies] == [
        (engine_pb2.KV_TIER_HOST, engine_pb2.KV_TIER_DISK),
        (engine_pb2.KV_TIER_DEVICE, engine_pb2.KV_TIER_HOST),
        (engine_pb2.KV_TIER_HOST, engine_pb2.KV_TIER_DEVICE),
    ]
    offload.check_integrity()


def test_each_tier_evicts_least_recently_used_and_never_a_slot_in_use() -> None:
    offload = KVOffload(num_host_blocks=2, num_disk_blocks=2)
    keys = [(h, 0, (h,)) for h in range(10, 16)]
    for block_id, key in enumerate(keys[:2]):
        offload.store(block_id, key)
    offload.take_copies()
    assert offload.find([keys[0]]) == [(HOST, 0)]  # key 0 is now the most recently used
    offload.store(2, keys[2])  # evicts key 1 (LRU) to the disk
    assert offload.find([keys[1]]) == [(DISK, 0)]
    offload.take_copies()
    # A hit locked for this plan is not evicted, however old: key 2 is (key 0 locked).
    hits = offload.find([keys[0]])
    offload.lock(hits)
    offload.store(3, keys[3])
    assert offload.find([keys[2]]) == [(DISK, 1)]
    assert offload.find([keys[0]]) == hits
    # Both host slots locked now (one read, one written): a third store is dropped.
    offload.store(4, keys[4])
    assert offload.counters.dropped_blocks[HOST] == 1
    assert offload.find([keys[4]]) == []
    # A disk full of older blocks drops its least recently used (key 1: key 2 was found later).
    offload.take_copies()
    offload.store(5, keys[5])
    assert offload.find([keys[1]]) == [] and offload.counters.dropped_blocks[DISK] == 1
    offload.check_integrity()


def round_robin(s: Scheduler, num_rounds: int) -> tuple[float, list[int]]:
    """Visit the 16 shared prefixes round-robin num_rounds times (a unique 2-token suffix each
    visit, 2 tokens out), one request at a time. Returns the prefix hit rate over the rounds
    after the first (hit tokens / prefix tokens), and the hit tokens per request."""
    hits = []
    seq_id = 0
    for _ in range(num_rounds):
        for i in range(NUM_PREFIXES):
            seq_id += 1
            before = s.counters.num_prefix_cache_hit_tokens
            run(s, request(seq_id, [*prefix(i), 900 + seq_id % 50, 950 + seq_id % 40]))
            hits.append(s.counters.num_prefix_cache_hit_tokens - before)
    later = hits[NUM_PREFIXES:]
    return sum(later) / (len(later) * PREFIX_BLOCKS * BS), hits


# The prefix hit rate after the first round: the 16 prefixes (64 blocks) do not fit the device
# pool of 32, so round-robin LRU finds none of them there; a host tier of 64 blocks holds them all.
HOST_TIER_HIT_RATE = 0.9


@pytest.mark.parametrize(("num_host", "num_disk"), [(64, 0), (8, 64)], ids=["host", "host+disk"])
def test_lower_tiers_raise_the_prefix_hit_rate_of_a_thrashing_workload(
    num_host: int, num_disk: int
) -> None:
    without, _ = round_robin(make(num_blocks=32), 3)
    assert without == 0.0  # LRU over 16 prefixes in a pool holding fewer: every visit misses
    s = make(num_blocks=32, num_host=num_host, num_disk=num_disk)
    rate, hits = round_robin(s, 3)
    assert rate >= HOST_TIER_HIT_RATE, hits
    offload = s.block_manager.offload
    assert offload is not None
    if num_disk:
        assert offload.counters.hit_blocks[DISK] > 0 and offload.counters.blocks_in[DISK] > 0
    else:
        assert offload.counters.hit_blocks[HOST] > 0 and offload.counters.blocks_in[DISK] == 0


def test_abort_while_waiting_for_a_swap_in_frees_its_pins() -> None:
    s = make(num_blocks=6, num_host=4)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(s, request(1, a, max_tokens=1), request(2, list(range(20, 43)), max_tokens=1))
    s.add(request(3, a, max_tokens=1))
    plan = step(s)
    assert named(plan.kv_copies[-1]) == (HOST, DEVICE, [1, 0], [0, 1])
    assert s.block_manager.pins == {3: [0, 1]}
    s.abort(3)
    assert s.block_manager.pins == {} and s.block_manager.num_free_blocks == 6
    s.check_integrity()


def test_engine_reset_forgets_every_tier() -> None:
    s = make(num_blocks=6, num_host=4)
    run(
        s,
        request(1, list(range(1, 10)), max_tokens=1),
        request(2, list(range(20, 40)), max_tokens=1),
    )
    offload = s.block_manager.offload
    assert offload is not None and offload.host.hash_to_slot
    s.reset_engine()
    assert not offload.host.hash_to_slot and offload.take_copies() == []
    s.check_integrity()


def test_swap_preemption_copies_the_victims_blocks_down_and_brings_them_back() -> None:
    """Two requests outgrow a pool of 8 blocks; the newer is preempted. With swap its full
    blocks go to the host tier at once and its readmission is a swap-in; the tokens streamed
    are those of recompute (the fake engine's tokens do not depend on the KV, so this checks
    the bookkeeping: the engine test checks the KV)."""
    outputs = {}
    for mode in ("recompute", "swap"):
        s = make(num_blocks=8, num_host=16, preemption_mode=mode)
        a, b = request(1, list(range(1, 10)), 12), request(2, list(range(30, 39)), 12)
        run(s, a, b)
        assert s.counters.num_preemptions > 0
        offload = s.block_manager.offload
        assert offload is not None
        outputs[mode] = (a.token_ids, b.token_ids, offload.counters.hit_blocks[HOST])
    assert outputs["swap"][:2] == outputs["recompute"][:2]
    assert outputs["swap"][2] > 0


def test_swap_needs_the_prefix_cache() -> None:
    with pytest.raises(ValueError, match="preemption_mode='swap' needs enable_prefix_caching"):
        SchedulerConfig(preemption_mode="swap", enable_prefix_caching=False)


def test_offload_counts_reach_get_stats_and_the_metrics() -> None:
    """The tiers' counts as GetStats carries them (by tier) and as the scheduler's observed
    instruments read them (a `tier` label each), from one scenario: one swap-in of 2 blocks."""
    from llmserve.scheduler.service.convert import stats_to_proto
    from llmserve.scheduler.service.telemetry import SchedulerTelemetry

    s = make(num_blocks=6, num_host=4, num_disk=8)
    s.set_offload_tiers(4, 8, block_bytes=1000)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(s, request(1, a, max_tokens=1), request(2, list(range(20, 43)), max_tokens=1))
    run(s, request(3, [*a[:8], 50, 51], max_tokens=1))
    offload = s.block_manager.offload
    assert offload is not None
    stats = {"num_blocks": 6, **offload.stats()}
    msg = stats_to_proto(stats)
    assert dict(msg.kv_offload_num_blocks) == {"host": 4, "disk": 8}
    assert dict(msg.kv_offload_hit_blocks) == {"host": 2, "disk": 0}
    assert dict(msg.kv_offload_blocks_in) == {"device": 2, "host": 4, "disk": 0}
    assert dict(msg.kv_offload_bytes_in) == {"device": 2000, "host": 4000, "disk": 0}
    assert msg.num_swap_ins == 1 and msg.swap_in_wait_s > 0
    observe = SchedulerTelemetry(lambda: stats)._observe
    assert sorted(observe("kv_offload_hit_blocks")) == [
        (0, {"tier": "disk"}),
        (2, {"tier": "host"}),
    ]
    assert observe("num_swap_ins") == [(1, {})]
    assert SchedulerTelemetry(lambda: {"num_blocks": 6})._observe("num_swap_ins") == []


def test_a_running_request_short_of_blocks_takes_pinned_ones_before_preempting() -> None:
    """Blocks pinned for a swap-in are the first a running request short of blocks gets: the
    pins go, nobody is preempted, and the waiting request swaps in again later."""
    s = make(num_blocks=6, num_host=8)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run(s, request(1, a, max_tokens=1), request(2, list(range(20, 43)), max_tokens=1))
    s.add(request(3, list(range(50, 65)), max_tokens=6))  # 4 blocks, a 5th at token 17
    step(s)
    s.add(request(4, a, max_tokens=1))
    plan = step(s)  # 3 decodes its 16th token; 4 swaps in: the last 2 free blocks pinned
    assert s.block_manager.pins == {4: plan.kv_copies[-1].dst_ids}
    assert s.block_manager.num_free_blocks == 0
    step(s)  # 3 needs a 5th block: the pins go
    assert s.block_manager.pins == {} and len(s.requests[3].block_table) == 5
    run(s)
    assert s.counters.num_preemptions == 0
    assert s.requests == {}
    s.check_integrity()
