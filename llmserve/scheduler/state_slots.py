"""The engine's recurrent-state slots, owned here as blocks are owned by the block manager:
hybrid linear-attention models (Qwen3-Next's gated DeltaNet layers, Mamba-2 hybrids) keep one
fixed-size state per running request (every state layer's conv and SSM / delta-rule state),
in slot `state_slot` of the engine's state pool (docs/architecture.md#state-slots).

A request takes a slot when it is admitted and gives it back when it finishes, is aborted or is
preempted (it is recomputed from its tokens, so its state is rebuilt). With no slots (a model
without state layers) nothing here is used and every request's slot stays None.

`StateSnapshots` (held as `snapshots`) is the prefix cache's share for such a model: the state
after a cached block, kept in snapshot slots of the same pool, so a hit can start a request from
that block's end (docs/architecture.md#state-snapshots).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Container

from llmserve.scheduler.plan import SnapshotTaken, StepPlan
from llmserve.scheduler.request import Request, RequestStatus


class StateSlots:
    """Slots 0 .. num_slots - 1, free ones handed out lowest first after a reset, then in the
    order they were freed (a FIFO, so a slot just freed is the last reused)."""

    def __init__(self, num_slots: int = 0, num_snapshot_slots: int = 0, block_size: int = 1):
        """num_snapshot_slots: the pool's slots after these, for state snapshots (0: none, and
        no prefix cache for a model with state layers)."""
        assert num_slots >= 0
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))
        self.snapshots = StateSnapshots(
            num_snapshot_slots if num_slots else 0, num_slots, block_size
        )

    @property
    def enabled(self) -> bool:
        """Whether the model has state layers (each running request then needs a slot)."""
        return self.num_slots > 0

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_allocate(self) -> bool:
        """Whether one more request can run: always without state layers."""
        return not self.enabled or bool(self.free_slots)

    def allocate(self, request: Request) -> None:
        """Give request a free slot (none without state layers). Assumes can_allocate()."""
        assert request.state_slot is None, f"{request.request_id} holds slot {request.state_slot}"
        if self.enabled:
            request.state_slot = self.free_slots.popleft()

    def free(self, request: Request) -> None:
        """Take request's slot back, if it holds one."""
        if request.state_slot is not None:
            slot = request.state_slot
            assert slot not in self.free_slots, f"state slot {slot} freed twice"
            self.free_slots.append(request.state_slot)
            request.state_slot = None

    def check_integrity(
        self, requests: list[Request], cached_hashes: Container[int] | None = None
    ) -> None:
        """Every slot is free or held by exactly one of requests, never both; only running
        requests hold one. The snapshots' check too (cached_hashes: the prefix cache's)."""
        self.snapshots.check_integrity(cached_hashes)
        held = [r.state_slot for r in requests if r.state_slot is not None]
        for r in requests:
            if r.state_slot is not None:
                assert r.status == RequestStatus.RUNNING, (
                    f"{r.request_id} ({r.status}) holds a slot"
                )
        assert len(held) == len(set(held)), f"a state slot held twice: {sorted(held)}"
        assert not set(held) & set(self.free_slots), "a state slot both held and free"
        assert len(held) + len(self.free_slots) == self.num_slots, (
            f"{len(held)} held + {len(self.free_slots)} free state slots != {self.num_slots}"
        )
        assert all(0 <= s < self.num_slots for s in held), f"state slot out of range: {held}"


class StateSnapshots:
    """Snapshot slots first_id .. first_id + num_slots - 1 of the engine's state pool, each
    holding the state a request had when its computed tokens ended at a full block, keyed by
    that block's hash (common/block_hash.py: the hash chains the whole prefix and the adapter).

    A snapshot is taken by a plan (`take`: the engine copies the row's slot after the forward),
    becomes a hit once that plan's result is in (`settle`), is touched by each hit, and goes
    when its block leaves the prefix cache (`forget`), when a new snapshot needs its slot (least
    recently used first), or at `reset`. Only boundaries up to the prompt's last full block a
    later request can hit (`boundary`) are kept, and a state model's prefill chunks are cut to
    end on them (`align`): one copy per chunk, as vLLM's "align" mode."""

    def __init__(self, num_slots: int, first_id: int, block_size: int):
        assert num_slots >= 0 and block_size > 0
        self.num_slots, self.first_id, self.block_size = num_slots, first_id, block_size
        self.free_slots: deque[int] = deque(range(first_id, first_id + num_slots))
        # block hash -> snapshot slot: settled snapshots, least recently used first.
        self.cached: OrderedDict[int, int] = OrderedDict()
        # block hash -> snapshot slot: taken by plans whose results are not in.
        self.pending: dict[int, int] = {}
        self.num_taken = self.num_hits = self.num_evicted = 0

    @property
    def enabled(self) -> bool:
        return self.num_slots > 0

    @property
    def num_used_slots(self) -> int:
        return len(self.cached) + len(self.pending)

    def boundary(self, request: Request) -> int:
        """The last token count at which request's state is worth keeping: the prompt's last
        full block that a request with the same prompt can hit (a hit leaves one token to
        compute), so ((num_prompt_tokens - 1) // block_size) * block_size."""
        bs = self.block_size
        return (request.num_prompt_tokens - 1) // bs * bs

    def align(self, request: Request, num_computed: int, num_new: int) -> int:
        """num_new (> 0) cut so that the chunk ends on a snapshot boundary when it can: at the
        end of its cached prefix (`cap_hit`'s junction) or at `boundary` when it would cross
        one, else at the last full block it reaches (unless that leaves nothing). Unchanged
        without snapshots, and past the boundary (decode).

            tokens: |<- num_computed ->|<- num_new ------------>|
                    |                  |<- aligned ->|          |
                                       block ends: ^      ^
        """
        boundary = self.boundary(request)
        if not self.enabled or num_computed >= boundary:
            return num_new
        end = num_computed + num_new
        for stop in (request.state_junction, boundary):
            if num_computed < stop < end:
                return stop - num_computed
        aligned = end // self.block_size * self.block_size
        return aligned - num_computed if aligned > num_computed else num_new

    def cap_hit(self, request: Request, cached_blocks: list[int]) -> tuple[list[int], int]:
        """The prefix-cache hit cached_blocks (request's first blocks) cut to the deepest block
        with a settled snapshot, and that snapshot's slot (0 with no snapshot: no hit). The
        snapshot counts as used now. When the cached prefix goes deeper than that, its end is
        request's `state_junction`: its chunk stops there and leaves a snapshot, so the next
        request sharing the prefix (a system prompt before different questions) hits all of
        it. Unchanged without snapshots."""
        if not self.enabled:
            return cached_blocks, 0
        junction = len(cached_blocks) * self.block_size
        request.state_junction = junction if junction <= self.boundary(request) else 0
        for n in range(len(cached_blocks), 0, -1):
            block_hash = request.block_hashes[n - 1]
            slot = self.cached.get(block_hash)
            if slot is not None:
                self.cached.move_to_end(block_hash)
                self.num_hits += 1
                return cached_blocks[:n], slot
        return [], 0

    def take(self, plan: StepPlan) -> None:
        """List in plan the snapshots its rows make: a row whose request's computed tokens
        (advanced by the plan) end at a full block up to `boundary`, not snapshotted yet, gets a
        free snapshot slot (or the least recently used one's). Rows advance by make_plan first."""
        if not self.enabled:
            return
        for request in plan.requests:
            end = request.num_computed_tokens
            if request.state_slot is None or not 0 < end <= self.boundary(request):
                continue
            if end % self.block_size:
                continue
            block_hash = request.block_hashes[end // self.block_size - 1]
            if block_hash in self.pending or block_hash in self.cached:
                continue
            slot = self._allocate()
            if slot is None:
                return  # every snapshot slot is being taken by plans in flight
            self.pending[block_hash] = slot
            self.num_taken += 1
            plan.state_snapshots.append(
                SnapshotTaken(
                    request, request.num_preemptions, block_hash, request.state_slot, slot
                )
            )

    def _allocate(self) -> int | None:
        """A free snapshot slot, or the least recently used snapshot's (dropped); None when
        all are pending."""
        if self.free_slots:
            return self.free_slots.popleft()
        if not self.cached:
            return None
        _, slot = self.cached.popitem(last=False)
        self.num_evicted += 1
        return slot

    def settle(self, plan: StepPlan, is_cached: Callable[[int], bool]) -> None:
        """plan's result is in (before its tokens are applied): each snapshot it took is a hit
        from now on when its request ran the row (still running, not preempted since: a
        refused or aborted row may not have run) and its block is still cached; else its slot
        is free again."""
        for s in plan.state_snapshots:
            if self.pending.get(s.block_hash) != s.to_slot:
                continue  # reset since the plan
            del self.pending[s.block_hash]
            r = s.request
            ran = r.status == RequestStatus.RUNNING and r.num_preemptions == s.num_preemptions
            if ran and is_cached(s.block_hash):
                self.cached[s.block_hash] = s.to_slot
            else:
                self.free_slots.append(s.to_slot)

    def forget(self, block_hash: int) -> None:
        """The block of block_hash left the prefix cache: its snapshot goes (a pending one is
        dropped when it settles)."""
        slot = self.cached.pop(block_hash, None)
        if slot is not None:
            self.free_slots.append(slot)

    def reset(self) -> None:
        """Forget every snapshot (the engine lost its pool, or plans in flight were lost)."""
        self.cached.clear()
        self.pending.clear()
        self.free_slots = deque(range(self.first_id, self.first_id + self.num_slots))

    def check_integrity(self, cached_hashes: Container[int] | None = None) -> None:
        """Every snapshot slot is free, cached or pending, exactly once; a cached snapshot's
        block is in the prefix cache (cached_hashes, when given)."""
        used = [*self.cached.values(), *self.pending.values()]
        every = sorted([*used, *self.free_slots])
        assert every == list(range(self.first_id, self.first_id + self.num_slots)), (
            f"snapshot slots: {len(self.free_slots)} free + {len(used)} used, "
            f"{len(set(every))} distinct, of {self.num_slots}"
        )
        if cached_hashes is not None:
            stale = [h for h in self.cached if h not in cached_hashes]
            assert not stale, f"{len(stale)} state snapshots of blocks not in the prefix cache"
