"""gateway/router.py: which replica each request goes to, exactly, for each policy; health and
spilling. No gRPC: the router is fed stats and health as gateway/replicas.py feeds it."""

from __future__ import annotations

import pytest

from llmserve.common.block_hash import block_hashes
from llmserve.gateway.router import Replica, ReplicaLoad, Router

A, B, C = "a:1", "b:1", "c:1"
BS = 4


def router(policy: str, addresses: tuple[str, ...] = (A, B), **kwargs: int) -> Router:
    r = Router(addresses, policy, **kwargs)
    r.block_size = BS
    for address in addresses:
        r.on_stats(address, True, ReplicaLoad())
    return r


def prompt(first: int, num_tokens: int = 3 * BS + 1) -> list[int]:
    return list(range(first, first + num_tokens))


def routed(r: Router, token_ids: list[int], exclude: frozenset[str] = frozenset()) -> str:
    replica = r.route(token_ids, exclude)
    assert replica is not None
    return replica.address


def test_round_robin_takes_turns_over_healthy_replicas() -> None:
    r = router("round-robin", (A, B, C))
    assert [routed(r, prompt(0)) for _ in range(4)] == [A, B, C, A]
    r.on_lost(B)
    assert [routed(r, prompt(0)) for _ in range(2)] == [A, C]  # turns 4, 5 of [A, C]


def test_least_load_counts_in_flight_and_reported_load() -> None:
    r = router("least-load", (A, B, C))
    assert [routed(r, prompt(0)) for _ in range(3)] == [A, B, C]  # ties: the first listed
    r.done(r.replicas[B])
    assert routed(r, prompt(0)) == B  # B has 0 in flight, A and C 1
    # B's scheduler reports 5 running + 2 waiting (another gateway's): load 7 beats 2 in flight.
    r.on_stats(B, True, ReplicaLoad(num_running=5, num_waiting=2))
    assert r.replicas[B].load == 7
    assert routed(r, prompt(0)) == A
    # Equal loads: the lower KV use wins.
    r.on_stats(A, True, ReplicaLoad(kv_usage=0.9))
    r.on_stats(C, True, ReplicaLoad(kv_usage=0.1))
    assert (r.replicas[A].load, r.replicas[C].load) == (2, 1)
    r.done(r.replicas[A])
    assert routed(r, prompt(0)) == C


def test_prefix_affinity_follows_the_shared_blocks() -> None:
    r = router("prefix")
    shared = prompt(0, 2 * BS)
    first = routed(r, [*shared, 100, 101, 102, 103, 104])
    assert first == A  # nobody holds it: the least loaded, the first listed on a tie
    # Another prefix goes to B (A has one in flight), and B keeps it.
    assert routed(r, prompt(50)) == B
    # Same 2 shared blocks, a different tail: back to A although A is as loaded as B.
    assert routed(r, [*shared, 200, 201, 202, 203, 204]) == A
    assert routed(r, prompt(50)) == B
    # The affinity table holds exactly the prompts' block hashes (scheduler's rule).
    assert r.affinity[block_hashes(shared, BS)[-1]] == A
    assert r.affinity[block_hashes(prompt(50), BS)[-1]] == B


def test_prefix_longest_holder_wins() -> None:
    r = router("prefix")
    one_block = prompt(0, BS)
    assert routed(r, [*one_block, 7]) == A
    # B is given the longer prefix by excluding A (as a retry would).
    longer = prompt(0, 3 * BS)
    assert routed(r, [*longer, 7], exclude=frozenset({A})) == B
    # Block 0 stays A's (A is healthy), blocks 1 and 2 are B's: the deepest match is B.
    hashes = block_hashes(longer, BS)
    assert [r.affinity[h] for h in hashes] == [A, B, B]
    assert routed(r, [*longer, 9]) == B
    assert routed(r, [*one_block, 9, 9, 9, 9, 9]) == A


def test_prefix_spills_past_the_threshold() -> None:
    r = router("prefix", spill_threshold=2)
    hot = prompt(0)
    assert [routed(r, hot) for _ in range(3)] == [A, A, A]  # loads 0-0, 1-0, 2-0: within 2
    assert routed(r, hot) == B  # A's 3 exceeds B's 0 by more than 2: spill
    assert routed(r, hot) == A  # A 3, B 1: within 2 again
    assert r.affinity[block_hashes(hot, BS)[-1]] == A  # the holder keeps the prefix


def test_prompt_shorter_than_a_block_goes_by_load() -> None:
    r = router("prefix")
    assert [routed(r, [1, 2]) for _ in range(3)] == [A, B, A]
    assert not r.affinity


def test_down_replica_is_routed_around_and_forgotten_until_it_rejoins() -> None:
    r = router("prefix")
    assert routed(r, prompt(0)) == A
    r.on_lost(A)
    assert not r.affinity  # A's blocks may be gone with it
    assert routed(r, prompt(0)) == B
    assert r.route(prompt(0), exclude=frozenset({B})) is None
    r.on_stats(A, True, ReplicaLoad())  # healthy again
    assert routed(r, prompt(0)) == B  # the prefix is B's now
    assert routed(r, prompt(70)) == A  # new prefixes: A is less loaded (0 vs 2 in flight)


def test_reachable_but_not_ready_is_a_last_resort() -> None:
    """With no ready replica, one whose scheduler answers gets the request (it then refuses
    UNAVAILABLE or queues it while its engine restarts), as a lone scheduler would."""
    r = router("least-load")
    r.on_stats(A, False, ReplicaLoad())
    assert routed(r, prompt(0)) == B
    r.on_stats(B, False, ReplicaLoad())
    assert routed(r, prompt(0)) == A
    r.on_lost(A)
    r.on_lost(B)
    assert r.route(prompt(0)) is None


def test_set_replicas_adds_down_and_drops_with_affinity() -> None:
    r = router("prefix")
    assert routed(r, prompt(0)) == A
    r.set_replicas([B, C])
    assert list(r.replicas) == [B, C] and not r.affinity
    assert not r.replicas[C].healthy and r.replicas[C].reachable is False
    assert routed(r, prompt(0)) == B  # C is down until its first stats


def test_done_balances_route() -> None:
    r = router("least-load")
    replica = r.route(prompt(0))
    assert isinstance(replica, Replica) and replica.num_in_flight == 1
    r.done(replica)
    assert replica.num_in_flight == 0 and replica.num_routed == 1
    with pytest.raises(AssertionError):
        r.done(replica)


def test_affinity_table_is_bounded_lru() -> None:
    r = router("prefix", max_affinity_entries=3)
    routed(r, prompt(0, 2 * BS))  # 2 hashes
    routed(r, prompt(100, 2 * BS))  # 2 more: the oldest forgotten
    assert len(r.affinity) == 3
    assert block_hashes(prompt(0, 2 * BS), BS)[0] not in r.affinity


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="routing='random' is not one of prefix"):
        Router([A], "random")
    with pytest.raises(ValueError, match="spill_threshold=-1 must be >= 0"):
        Router([A], "prefix", spill_threshold=-1)


# -- the gateway's scheduler addresses ------------------------------------------------------------


def test_dns_address_stands_for_every_address_of_the_name() -> None:
    import asyncio

    from llmserve.gateway.replicas import resolve_addresses

    resolved = asyncio.run(resolve_addresses(("a:1", "dns:///localhost:50052", "b:2")))
    assert resolved[0] == "a:1" and resolved[-1] == "b:2"
    assert "127.0.0.1:50052" in resolved[1:-1]
    assert set(resolved[1:-1]) <= {"127.0.0.1:50052", "[::1]:50052"}
    assert asyncio.run(resolve_addresses(("dns:///no-such-host.invalid:1",))) == []


def test_scheduler_addresses_are_checked_and_repeatable() -> None:
    from llmserve.cli import build_parser
    from llmserve.common.flags import from_flags
    from llmserve.gateway.config import GatewayConfig

    args = build_parser().parse_args(
        ["gateway", "--scheduler-address", "a:1", "--scheduler-address", "dns:///b:2"]
    )
    assert from_flags(GatewayConfig, args).scheduler_address == ("a:1", "dns:///b:2")
    default = from_flags(GatewayConfig, build_parser().parse_args(["gateway"]))
    assert default.scheduler_address == ("localhost:50052",)
    assert GatewayConfig(scheduler_address="x:3").scheduler_address == ("x:3",)  # type: ignore[arg-type]
    for bad, message in (
        (("a",), "scheduler_address='a' is not HOST:PORT or dns:///NAME:PORT"),
        (("a:0",), "scheduler_address='a:0' is not HOST:PORT"),
        (("a:1", "a:1"), r"scheduler_address=\['a:1', 'a:1'\] repeats one"),
        ((), "scheduler_address is empty"),
    ):
        with pytest.raises(ValueError, match=message):
            GatewayConfig(scheduler_address=bad)
    with pytest.raises(ValueError, match="routing_spill_threshold=-1 must be >= 0"):
        GatewayConfig(routing_spill_threshold=-1)


def test_a_replica_serving_something_else_is_refused() -> None:
    """The first replica's limits are the gateway's (and its block size the router's); a later
    one must agree on model, context, vocabulary and block size."""
    from llmserve.gateway.config import GatewayConfig
    from llmserve.gateway.core import GatewayCore
    from llmserve.gateway.replicas import ReplicaLink, ReplicaMismatch
    from llmserve.protos import scheduler_pb2

    core = GatewayCore(GatewayConfig(scheduler_address=(A, B)), tokenizer=None)  # type: ignore[arg-type]
    info = scheduler_pb2.SchedulerInfo(
        model="m", max_model_len=512, vocab_size=100, block_size=16, num_blocks=8
    )
    core.replicas._adopt_info(ReplicaLink(A, None, None), info)  # type: ignore[arg-type]
    assert core.replicas.router.block_size == 16 and core.replicas.limits is not None
    assert core.replicas.limits.kv_capacity_tokens == 128
    other = scheduler_pb2.SchedulerInfo()
    other.CopyFrom(info)
    other.block_size = 32
    with pytest.raises(ReplicaMismatch, match="block_size=32 at b:1, but 16 at the first replica"):
        core.replicas._adopt_info(ReplicaLink(B, None, None), other)  # type: ignore[arg-type]
    other.block_size, other.num_blocks = 16, 4  # a smaller pool is fine
    core.replicas._adopt_info(ReplicaLink(B, None, None), other)  # type: ignore[arg-type]


def test_ties_go_to_the_replica_holding_fewer_blocks_then_fewer_requests() -> None:
    """Idle replicas (load 0 each) share new prefixes by the blocks they hold, so the caches
    fill evenly; least-load shares requests by the number routed."""
    r = router("prefix")
    owners = []
    for first in (0, 100, 200, 300):
        replica = r.route(prompt(first))  # 3 blocks each
        assert replica is not None
        owners.append(replica.address)
        r.done(replica)  # finished: both idle again
    assert owners == [A, B, A, B]
    assert (r.replicas[A].num_blocks_held, r.replicas[B].num_blocks_held) == (6, 6)
    r.on_lost(B)
    assert (r.replicas[A].num_blocks_held, r.replicas[B].num_blocks_held) == (6, 0)
    lru = router("prefix", max_affinity_entries=4)
    lru.route(prompt(0))  # A: 3 blocks
    lru.route(prompt(100))  # B: 3 blocks; A's 2 oldest forgotten
    assert (lru.replicas[A].num_blocks_held, lru.replicas[B].num_blocks_held) == (1, 3)
    least = router("least-load")
    routed_to = []
    for _ in range(4):
        replica = least.route(prompt(0))
        assert replica is not None
        routed_to.append(replica.address)
        least.done(replica)
    assert routed_to == [A, B, A, B]
