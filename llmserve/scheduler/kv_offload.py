"""KV offload: the tiers under the engine's KV pool, as the scheduler indexes them.

    device pool (BlockManager)   --evicted-->   host tier   --evicted-->   disk tier
          ^                                          |                          |
          +------------- prefix hit: copied back ----+--------------------------+

Each tier is an index from a block's chained content hash (common/block_hash.py) to its slot,
least recently used first, inclusive of the tiers above. Nothing moves here: each decision
appends a copy to `pending`, which the next plan carries to the engine (BlockCopies, in
`take_copies`' order); an eviction never picks a slot the plan already touches (`_locked`), so
that order suffices. The engine's side is engine/kv/offload.py; the rules:
docs/architecture.md#kv-tiers-copies-in-the-plan.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from llmserve.common.step_plan import KV_TIERS, BlockCopies

# A cached block's identity: (its hash, its parent's hash, its tokens), as BlockManager keys it.
BlockKey = tuple[int, int, tuple[int, ...]]

DEVICE, HOST, DISK = "device", "host", "disk"
# The order the engine executes a plan's batches in (see the module docstring).
COPY_ORDER: tuple[tuple[str, str], ...] = (
    (HOST, DISK),
    (DEVICE, HOST),
    (HOST, DEVICE),
    (DISK, DEVICE),
)


@dataclass
class OffloadCounters:
    """Cumulative since start; GetStats and the metrics read them. Keyed by tier name."""

    # Blocks found in a lower tier by a prefix lookup and brought back to the device.
    hit_blocks: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})
    # Blocks copied into each tier (host: from the device; disk: from the host; device: from
    # either lower tier).
    blocks_in: dict[str, int] = field(default_factory=lambda: {DEVICE: 0, HOST: 0, DISK: 0})
    # Blocks a tier dropped for room (the disk tier's, or the host's without a disk tier).
    dropped_blocks: dict[str, int] = field(default_factory=lambda: {HOST: 0, DISK: 0})
    # Requests that waited for a swap-in, and the seconds they waited in all.
    num_swap_ins: int = 0
    swap_in_wait_s: float = 0.0


class TierIndex:
    """One lower tier's slots: which block (by key) each holds, least recently used first."""

    def __init__(self, name: str, num_slots: int):
        assert num_slots > 0
        self.name = name
        self.num_slots = num_slots
        self.hash_to_slot: OrderedDict[int, int] = OrderedDict()  # LRU first
        self.slot_key: dict[int, BlockKey] = {}
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0 first

    def lookup(self, key: BlockKey) -> int | None:
        """The slot holding key's block (confirmed by its tokens), made the most recently used;
        None when this tier does not hold it."""
        slot = self.hash_to_slot.get(key[0])
        if slot is None or self.slot_key[slot] != key:
            return None
        self.hash_to_slot.move_to_end(key[0])
        return slot

    def take_slot(self, locked: set[tuple[str, int]]) -> tuple[int, BlockKey | None] | None:
        """A slot to write a block into: a free one, or else the least recently used one not in
        locked (its block is evicted: returned with the slot, forgotten here). None when every
        used slot is locked."""
        if self.free_slots:
            return self.free_slots.pop(), None
        for block_hash, slot in self.hash_to_slot.items():
            if (self.name, slot) not in locked:
                del self.hash_to_slot[block_hash]
                return slot, self.slot_key.pop(slot)
        return None

    def put(self, slot: int, key: BlockKey) -> None:
        """Record that slot now holds key's block (most recently used)."""
        assert slot not in self.slot_key, f"{self.name} slot {slot} holds a block already"
        self.slot_key[slot] = key
        self.hash_to_slot[key[0]] = slot

    def reset(self) -> None:
        self.hash_to_slot.clear()
        self.slot_key.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))

    def check_integrity(self) -> None:
        assert len(self.slot_key) + len(self.free_slots) == self.num_slots, "slots lost"
        assert len(self.hash_to_slot) == len(self.slot_key), "index and keys disagree"
        for block_hash, slot in self.hash_to_slot.items():
            assert self.slot_key[slot][0] == block_hash, f"{self.name} slot {slot}: wrong hash"
        assert not set(self.free_slots) & set(self.slot_key), f"{self.name}: a free slot is used"


class KVOffload:
    """The host tier (num_host_blocks slots) and, under it, the disk tier (num_disk_blocks; 0:
    none), with the copies decided since the last plan."""

    def __init__(self, num_host_blocks: int, num_disk_blocks: int = 0, block_bytes: int = 0):
        """block_bytes: what one block's copy moves (the engine's kv_block_bytes; 0: unknown),
        for the byte counts."""
        self.block_bytes = block_bytes
        self.host = TierIndex(HOST, num_host_blocks)
        self.disk = TierIndex(DISK, num_disk_blocks) if num_disk_blocks else None
        self.pending: dict[tuple[str, str], list[tuple[int, int]]] = {k: [] for k in COPY_ORDER}
        # (tier, slot) read or written by the copies pending: not evicted before they are sent.
        self._locked: set[tuple[str, int]] = set()
        self.counters = OffloadCounters()

    def _copy(self, src: str, src_id: int, dst: str, dst_id: int) -> None:
        self.pending[(src, dst)].append((src_id, dst_id))
        self._locked.update({(src, src_id), (dst, dst_id)})
        self.counters.blocks_in[dst] += 1

    def store(self, block_id: int, key: BlockKey) -> None:
        """The device pool is about to reuse cached block block_id: keep its contents in the
        host tier (a copy down; nothing when the host tier holds them already). Called before
        anything writes the block in this plan."""
        if self.host.lookup(key) is not None:
            return
        taken = self.host.take_slot(self._locked)
        if taken is None:
            self.counters.dropped_blocks[HOST] += 1
            return
        slot, evicted = taken
        if evicted is not None:
            self._store_on_disk(slot, evicted)
        self._copy(DEVICE, block_id, HOST, slot)
        self.host.put(slot, key)

    def _store_on_disk(self, host_slot: int, key: BlockKey) -> None:
        """The host tier evicts key's block from host_slot: copy it to the disk tier, or drop it
        without one."""
        if self.disk is None:
            self.counters.dropped_blocks[HOST] += 1
            return
        if self.disk.lookup(key) is not None:
            return
        taken = self.disk.take_slot(self._locked)
        if taken is None:
            self.counters.dropped_blocks[DISK] += 1
            return
        slot, evicted = taken
        self.counters.dropped_blocks[DISK] += evicted is not None
        self._copy(HOST, host_slot, DISK, slot)
        self.disk.put(slot, key)

    def find(self, keys: list[BlockKey]) -> list[tuple[str, int]]:
        """(tier, slot) of keys' blocks, in order, up to the first not held in a lower tier.
        Found slots become the most recently used; nothing else changes."""
        found: list[tuple[str, int]] = []
        for key in keys:
            slot = self.host.lookup(key)
            if slot is not None:
                found.append((HOST, slot))
                continue
            slot = self.disk.lookup(key) if self.disk is not None else None
            if slot is None:
                break
            found.append((DISK, slot))
        return found

    def lock(self, hits: list[tuple[str, int]]) -> None:
        """Keep hits' slots from being evicted until the next plan is sent (they are about to be
        read: call before allocating the device blocks they go to)."""
        self._locked.update(hits)

    def bring_back(self, hit: tuple[str, int], block_id: int) -> None:
        """Copy a lower-tier hit (tier, slot) to device block block_id."""
        tier, slot = hit
        self._copy(tier, slot, DEVICE, block_id)
        self.counters.hit_blocks[tier] += 1

    def take_copies(self) -> list[BlockCopies]:
        """The copies decided since the last call, as batches in COPY_ORDER (empty batches left
        out); the slots' locks are released."""
        batches = []
        for (src, dst), pairs in self.pending.items():
            if pairs:
                src_ids, dst_ids = [p[0] for p in pairs], [p[1] for p in pairs]
                batches.append(BlockCopies(KV_TIERS[src], KV_TIERS[dst], src_ids, dst_ids))
                pairs.clear()
        self._locked.clear()
        return batches

    def reset(self) -> None:
        """Forget every tier's contents (the engine restarted: its host and disk tiers went with
        it) and any copy not sent."""
        self.host.reset()
        if self.disk is not None:
            self.disk.reset()
        self.take_copies()

    def stats(self) -> dict[str, object]:
        """The tiers' counts as GetStats names them (scheduler.proto's kv_offload_* fields)."""
        c = self.counters
        sizes = {DISK: self.disk.num_slots} if self.disk is not None else {}
        return {
            "kv_offload_num_blocks": {HOST: self.host.num_slots, **sizes},
            "kv_offload_hit_blocks": dict(c.hit_blocks),
            "kv_offload_blocks_in": dict(c.blocks_in),
            "kv_offload_bytes_in": {t: n * self.block_bytes for t, n in c.blocks_in.items()},
            "kv_offload_dropped_blocks": dict(c.dropped_blocks),
            "num_swap_ins": c.num_swap_ins,
            "swap_in_wait_s": c.swap_in_wait_s,
        }

    def check_integrity(self) -> None:
        self.host.check_integrity()
        if self.disk is not None:
            self.disk.check_integrity()
