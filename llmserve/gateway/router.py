"""Which scheduler replica serves a request: the gateway's routing policy over D replicas (each a
scheduler and its engines), from what it knows without asking anyone per request.

`--routing` round-robin, least-load, or prefix (the replica holding the longest prefix of the
prompt's KV blocks, by common/block_hash.py's chained hashes, spilling to the least-loaded one
past spill_threshold). A replica's load is the larger of this gateway's requests in flight on
it and the running + waiting requests its scheduler last reported. Only healthy replicas are
routed to; a replica that goes down loses its affinity entries. The router does no I/O:
gateway/replicas.py feeds it stats and health, gateway/streaming.py calls `route` / `done`.
See docs/parallelism.md#many-replicas-data-parallelism-and-routing.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from llmserve.common.block_hash import block_hashes

ROUTING_POLICIES = ("prefix", "least-load", "round-robin")
MAX_AFFINITY_BLOCKS = 64  # a prompt's first blocks hashed for affinity (longer is rarely shared)
MAX_AFFINITY_ENTRIES = 1 << 18  # block hashes remembered, least recently routed forgotten first


@dataclass
class ReplicaLoad:
    """What a scheduler last reported about its load."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # used blocks / all blocks


@dataclass
class Replica:
    address: str
    healthy: bool = False  # its scheduler is ready (stats stream alive, engine answering)
    reachable: bool = False  # its stats stream is alive
    num_in_flight: int = 0  # this gateway's requests on it now
    num_routed: int = 0  # requests routed to it, ever (retries count again)
    num_blocks_held: int = 0  # affinity entries naming it: the blocks it holds, as far as we know
    reported: ReplicaLoad = field(default_factory=ReplicaLoad)

    @property
    def load(self) -> int:
        return max(self.num_in_flight, self.reported.num_running + self.reported.num_waiting)


class Router:
    def __init__(
        self,
        addresses: Sequence[str],
        policy: str = "prefix",
        spill_threshold: int = 8,
        max_affinity_entries: int = MAX_AFFINITY_ENTRIES,
    ):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing={policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
        if spill_threshold < 0:
            raise ValueError(f"spill_threshold={spill_threshold} must be >= 0")
        self.policy = policy
        self.spill_threshold = spill_threshold
        self.max_affinity_entries = max_affinity_entries
        self.block_size: int | None = None  # learnt from a scheduler's GetInfo
        self.replicas: dict[str, Replica] = {}
        # Block hash -> the address it was last routed to; least recently routed first.
        self.affinity: OrderedDict[int, str] = OrderedDict()
        self._turn = itertools.count()
        self.set_replicas(addresses)

    # -- membership and health ------------------------------------------------------------------

    def set_replicas(self, addresses: Iterable[str]) -> None:
        """Make the replicas exactly addresses (in that order): new ones start down until their
        first stats; dropped ones are forgotten with their affinity entries."""
        wanted = list(dict.fromkeys(addresses))
        for address in [a for a in self.replicas if a not in wanted]:
            self._forget(address)
            del self.replicas[address]
        self.replicas = {a: self.replicas.get(a) or Replica(a) for a in wanted}

    def on_stats(self, address: str, ready: bool, load: ReplicaLoad) -> None:
        """A stats message from address's scheduler: it is reachable, healthy if ready."""
        replica = self.replicas.get(address)
        if replica is None:
            return
        replica.reported = load
        replica.reachable = True
        self._set_healthy(replica, ready)

    def on_lost(self, address: str) -> None:
        """address's stats stream broke or fell silent for a heartbeat: route around it."""
        replica = self.replicas.get(address)
        if replica is None:
            return
        replica.reachable = False
        replica.reported = ReplicaLoad()
        self._set_healthy(replica, False)

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        if replica.healthy and not healthy:
            self._forget(replica.address)
        replica.healthy = healthy

    def _forget(self, address: str) -> None:
        for block_hash in [h for h, a in self.affinity.items() if a == address]:
            del self.affinity[block_hash]
        self.replicas[address].num_blocks_held = 0

    @property
    def num_healthy(self) -> int:
        return sum(r.healthy for r in self.replicas.values())

    # -- routing ---------------------------------------------------------------------------------

    def route(
        self, prompt_token_ids: Sequence[int], exclude: AbstractSet[str] = frozenset()
    ) -> Replica | None:
        """The replica for a request with this prompt, not one in exclude (tried already), or
        None when no replica can take it. Counts the request in the replica's num_in_flight
        (call done() when the attempt ends) and, for the prefix policy, records that this
        replica now holds the prompt's blocks."""
        candidates = self._candidates(exclude)
        if not candidates:
            return None
        if self.policy == "round-robin":
            chosen = candidates[next(self._turn) % len(candidates)]
        elif self.policy == "least-load":
            chosen = _least_loaded(candidates)
        else:
            chosen = self._route_by_prefix(prompt_token_ids, candidates)
        chosen.num_in_flight += 1
        chosen.num_routed += 1
        return chosen

    def done(self, replica: Replica) -> None:
        """An attempt route() counted on replica ended (finished, failed or cancelled)."""
        assert replica.num_in_flight > 0, f"{replica.address}: done() without route()"
        replica.num_in_flight -= 1

    def _candidates(self, exclude: AbstractSet[str]) -> list[Replica]:
        """Healthy replicas not excluded; else reachable ones (their scheduler then answers)."""
        open_ = [r for r in self.replicas.values() if r.address not in exclude]
        return [r for r in open_ if r.healthy] or [r for r in open_ if r.reachable]

    def _route_by_prefix(self, token_ids: Sequence[int], candidates: list[Replica]) -> Replica:
        """The holder of the longest routed prefix among candidates, unless its load exceeds
        the least-loaded candidate's by more than spill_threshold; else the least loaded."""
        bs = self.block_size
        hashes = block_hashes(token_ids, bs, MAX_AFFINITY_BLOCKS) if bs else []
        least = _least_loaded(candidates)
        holder = self._holder(hashes, {r.address: r for r in candidates})
        chosen = least
        if holder is not None and holder.load - least.load <= self.spill_threshold:
            chosen = holder
        self._remember(hashes, chosen.address)
        return chosen

    def _holder(self, hashes: list[int], candidates: dict[str, Replica]) -> Replica | None:
        """The candidate last routed the longest prefix of hashes (a hash names its whole
        prefix, so the deepest one found wins)."""
        for block_hash in reversed(hashes):
            address = self.affinity.get(block_hash)
            if address in candidates:
                return candidates[address]
        return None

    def _remember(self, hashes: list[int], address: str) -> None:
        """Record address as the holder of hashes, except those a healthy other replica holds
        (a spilled request shares a prefix; its first holder keeps it)."""
        for block_hash in hashes:
            holder = self.affinity.get(block_hash)
            if holder is None or holder == address or not self._is_healthy(holder):
                self._hold(holder, -1)
                self._hold(address, +1)
                self.affinity[block_hash] = address
                self.affinity.move_to_end(block_hash)
        while len(self.affinity) > self.max_affinity_entries:
            self._hold(self.affinity.popitem(last=False)[1], -1)

    def _hold(self, address: str | None, delta: int) -> None:
        replica = self.replicas.get(address) if address is not None else None
        if replica is not None:
            replica.num_blocks_held += delta

    def _is_healthy(self, address: str) -> bool:
        replica = self.replicas.get(address)
        return replica is not None and replica.healthy


def _least_loaded(candidates: list[Replica]) -> Replica:
    """The least load, then the least KV use, then the fewest blocks held (so new prefixes
    spread over the caches), then the fewest requests routed, then the first listed."""
    return min(
        candidates,
        key=lambda r: (r.load, r.reported.kv_usage, r.num_blocks_held, r.num_routed),
    )
