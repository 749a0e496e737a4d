"""Paged KV-cache block bookkeeping: block tables, reference counts and the prefix cache.

A request's block table lists its blocks in token order: token t lives in block
`block_table[t // block_size]`, row `t % block_size`. A full block gets a chained content hash
(common/block_hash.py's rule, which the gateway's prefix routing uses too), so requests with the
same prefix share blocks; a freed block keeps its hash and contents in the free queue until
reused (lazy eviction, least recently freed first), and a hit is confirmed by comparing tokens.
With a sliding window, blocks no query reads again are released early (`_release_out_of_window`);
with KV offload (scheduler/kv_offload.py), an evicted cached block is copied down a tier and
blocks brought back are pinned for their request (`pin_new` / `unpin`). See
docs/architecture.md#memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from llmserve.common.block_hash import extend_block_hashes
from llmserve.scheduler.kv_offload import BlockKey, KVOffload
from llmserve.scheduler.request import Request


def held_blocks(request: Request) -> list[int]:
    """The blocks of request's table it still holds (not released out of a sliding window)."""
    return request.block_table[request.num_released_blocks :]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
        offload: KVOffload | None = None,
    ):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.ref_cnt: list[int] = [0] * num_blocks
        # Free blocks in eviction order: the first is reused first. Values unused.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # For each cached block: (its hash, its parent's hash, its tokens), to confirm hits.
        self.block_key: dict[int, BlockKey] = {}
        self.offload = offload if enable_prefix_caching else None
        # Blocks held for a waiting request (by seq_id) until it is admitted: its prefix, brought
        # back from a lower tier, and the device hits before it. Each pin is one reference.
        self.pins: dict[int, list[int]] = {}
        # Called with a block hash that leaves the prefix cache (a hybrid model's state
        # snapshot of it goes too: scheduler/state_slots.py).
        self.on_forget: Callable[[int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend request.block_hashes to cover every full block among its first num_tokens."""
        num_blocks = num_tokens // self.block_size
        extend_block_hashes(
            request.block_hashes,
            request.token_ids,
            self.block_size,
            num_blocks,
            request.block_hash_root,
        )

    def _block_key(self, request: Request, i: int) -> BlockKey:
        """request's block i as the prefix cache keys it: (its hash, its parent's hash, its
        tokens). Its hash must be known (_update_block_hashes)."""
        bs = self.block_size
        parent = request.block_hashes[i - 1] if i else request.block_hash_root
        return request.block_hashes[i], parent, tuple(request.token_ids[i * bs : (i + 1) * bs])

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Blocks already holding a prefix of request.token_ids, in order. Changes nothing.

        At least one token is always left to compute (the step must produce logits), so at most
        (num_tokens - 1) // block_size blocks are returned.
        """
        if not self.enable_prefix_caching or request.needs_prompt_logprobs:
            return []  # prompt logprobs: every prompt position is computed, to be scored
        max_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_blocks * self.block_size)
        found: list[int] = []
        for i in range(max_blocks):
            key = self._block_key(request, i)
            block_id = self.hash_to_block.get(key[0])
            if block_id is None or self.block_key[block_id] != key:
                break
            found.append(block_id)
        return found

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks among request's first num_tokens in the prefix cache."""
        self._update_block_hashes(request, num_tokens)
        # Released blocks were registered while held (they were full); their ids may be
        # someone else's now.
        for i in range(request.num_released_blocks, num_tokens // self.block_size):
            block_id = request.block_table[i]
            # Already cached, or the same content is cached in another block: keep that one.
            if block_id in self.block_key or request.block_hashes[i] in self.hash_to_block:
                continue
            self.block_key[block_id] = key = self._block_key(request, i)
            self.hash_to_block[key[0]] = block_id

    def _evict(self, block_id: int) -> None:
        """Free block block_id is about to be reused: forget its contents here (a cached block
        goes down to the offload tier first, when there is one)."""
        key = self.block_key.pop(block_id, None)
        if key is not None and self.hash_to_block.get(key[0]) == block_id:
            del self.hash_to_block[key[0]]
            if self.on_forget is not None:
                self.on_forget(key[0])
            if self.offload is not None:
                self.offload.store(block_id, key)

    def keys_after(self, request: Request, start: int) -> list[BlockKey]:
        """The keys of request's blocks from block start on, as far as find_cached_blocks looks
        (its blocks' hashes are known by then). Changes nothing."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        return [self._block_key(request, i) for i in range(start, max_blocks)]

    def cached_blocks_of(self, request: Request) -> list[tuple[int, BlockKey]]:
        """(block id, key) of request's blocks the prefix cache holds under their key (not a
        duplicate of another block's content), in order. Changes nothing."""
        found = []
        for block_id in request.block_table:
            key = self.block_key.get(block_id)
            if key is not None and self.hash_to_block.get(key[0]) == block_id:
                found.append((block_id, key))
        return found

    # -- pins (KV offload) ----------------------------------------------------------------------

    def pin(self, holder: int, block_ids: list[int]) -> None:
        """Hold block_ids (cached blocks) for holder, a waiting request's seq_id: a reference
        each, so they leave the free queue and are not evicted until `unpin`."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_cnt[block_id] += 1
        self.pins.setdefault(holder, []).extend(block_ids)

    def pin_new(self, holder: int, keys: list[BlockKey]) -> list[int]:
        """Take a free block per key (evicting what it cached), register it in the prefix cache
        under the key and pin it for holder; returns the blocks. Their contents arrive by copy
        (the caller lists it) before the plan after this one runs. Needs len(keys) free blocks."""
        assert len(keys) <= self.num_free_blocks
        block_ids = []
        for key in keys:
            block_id, _ = self.free_blocks.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            self.block_key[block_id] = key
            self.hash_to_block[key[0]] = block_id
            block_ids.append(block_id)
        self.pins.setdefault(holder, []).extend(block_ids)
        return block_ids

    def pin_fresh(self, holder: int, num_blocks: int) -> list[int]:
        """Take num_blocks free blocks (evicting what they cached) and pin them for holder,
        uncached: their contents arrive by a KV transfer (scheduler/disagg/handoffs.py) and enter
        the prefix cache only once it is done (`cache_block`). Needs num_blocks free blocks."""
        assert num_blocks <= self.num_free_blocks
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_blocks.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        self.pins.setdefault(holder, []).extend(block_ids)
        return block_ids

    def cache_block(self, block_id: int, key: BlockKey) -> None:
        """Held block block_id now holds key's content: register it in the prefix cache (unless
        that content is cached in another block already)."""
        assert self.ref_cnt[block_id] > 0 and block_id not in self.block_key
        if self.enable_prefix_caching and key[0] not in self.hash_to_block:
            self.block_key[block_id] = key
            self.hash_to_block[key[0]] = block_id

    def unpin(self, holder: int) -> None:
        """Drop holder's pins (it was admitted and holds its blocks itself, or it ended)."""
        for block_id in reversed(self.pins.pop(holder, [])):
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} unpinned twice"
            if self.ref_cnt[block_id] == 0:
                self.free_blocks[block_id] = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached block, in every tier (after the engine lost its KV pool)."""
        self.hash_to_block.clear()
        self.block_key.clear()
        for holder in list(self.pins):
            self.unpin(holder)
        if self.offload is not None:
            self.offload.reset()

    # -- allocation ---------------------------------------------------------------------------

    def _blocks_needed(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int]
    ) -> tuple[int, int, int]:
        """For allocate_slots' arguments: (the tokens request will span, the new blocks to
        allocate (<= 0: none), the free blocks all of it takes). Cached blocks nobody holds sit
        in the free queue; taking them uses up free blocks too."""
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = self.num_blocks_for(num_total) - len(request.block_table) - len(cached_blocks)
        num_reviving = sum(1 for b in cached_blocks if self.ref_cnt[b] == 0)
        return num_total, num_needed, max(num_needed, 0) + num_reviving

    def num_blocks_short(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> int:
        """How many more free blocks `allocate_slots` (same arguments) would need to succeed
        (0: it would). Changes nothing."""
        *_, num_taken = self._blocks_needed(request, num_new_tokens, cached_blocks or [])
        return max(0, num_taken - self.num_free_blocks)

    def num_owned_blocks(self, requests: list[Request]) -> int:
        """How many blocks of requests' block tables nobody else holds (ref count 1): what
        freeing them all would give back. Changes nothing."""
        ref_cnt = self.ref_cnt
        return sum(ref_cnt[b] == 1 for r in requests for b in held_blocks(r))

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Give request enough blocks for num_new_tokens beyond its computed ones.

            block_table: |<- cached_blocks ->|<- held already ->|<- allocated now ->|
            tokens:      |<- num_computed_tokens (+ cached) ->|<- num_new_tokens ->|

        cached_blocks (from find_cached_blocks, only when the request holds no blocks) are shared:
        their ref counts go up and they leave the free queue. Returns False, changing nothing, when
        too few blocks are free. Full blocks of known tokens are registered in the prefix cache (a
        block ending in a pending token waits for a later call, when the token is known).
        """
        cached_blocks = cached_blocks or []
        assert not cached_blocks or not request.block_table
        num_total, num_needed, num_taken = self._blocks_needed(
            request, num_new_tokens, cached_blocks
        )
        if num_taken > self.num_free_blocks:
            return False
        for block_id in cached_blocks:
            if self.ref_cnt[block_id] == 0:
                del self.free_blocks[block_id]
            self.ref_cnt[block_id] += 1
            request.block_table.append(block_id)
        for _ in range(num_needed):
            block_id, _ = self.free_blocks.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            request.block_table.append(block_id)
        if self.enable_prefix_caching:
            self.cache_full_blocks(request, min(num_total, len(request.token_ids)))
        self._release_out_of_window(request)
        return True

    def _release_out_of_window(self, request: Request) -> None:
        """Release request's blocks that no query of it reads again, as `free` would; they stay
        listed in its block table:

            block_table: |<- released ->|<- held: the window's keys and what comes next ->|
                         0     num_released_blocks                                len(block_table)

        The query at position p reads keys p - window + 1 .. p, and the next query sits at
        num_computed_tokens or later, so blocks wholly before num_computed_tokens - window + 1
        go."""
        if self.sliding_window is None:
            return
        first_key = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(first_key, 0) // self.block_size, len(request.block_table))
        for block_id in request.block_table[request.num_released_blocks : num_out]:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_blocks[block_id] = None
        request.num_released_blocks = max(request.num_released_blocks, num_out)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free request's blocks beyond the first num_tokens tokens' (lookahead slots whose
        proposals were rejected), last first. They hold no known token, so none is cached."""
        keep = self.num_blocks_for(num_tokens)
        for block_id in reversed(request.block_table[keep:]):
            assert block_id not in self.block_key, f"block {block_id}: cached beyond the tokens"
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] == 0, f"block {block_id}: shared beyond the tokens"
            self.free_blocks[block_id] = None
        del request.block_table[keep:]

    def free(self, request: Request) -> None:
        """Release request's blocks. Blocks nobody else holds go to the back of the free queue,
        the request's last block first, so a prefix's tail is evicted before its head."""
        for block_id in reversed(held_blocks(request)):
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_cnt[block_id] == 0:
                self.free_blocks[block_id] = None
        request.block_table = []
        request.num_released_blocks = 0

    def check_integrity(self, requests: list[Request] | None = None) -> None:
        """Assert the bookkeeping is consistent. With `requests` (everyone holding blocks), also
        check that each block's ref count equals the number of block tables listing it."""
        assert len(self.free_blocks) + sum(1 for c in self.ref_cnt if c > 0) == self.num_blocks, (
            "free + used != total"
        )
        for block_id, count in enumerate(self.ref_cnt):
            assert count >= 0, f"block {block_id} has ref count {count}"
            assert (count == 0) == (block_id in self.free_blocks), (
                f"block {block_id}: ref count {count} but free={block_id in self.free_blocks}"
            )
        for block_hash, block_id in self.hash_to_block.items():
            assert self.block_key[block_id][0] == block_hash, f"hash map wrong for {block_id}"
        if requests is not None:
            held = [0] * self.num_blocks
            for block_id in (b for pinned in self.pins.values() for b in pinned):
                held[block_id] += 1
            for request in requests:
                for block_id in held_blocks(request):
                    held[block_id] += 1
            assert held == self.ref_cnt, "ref counts disagree with the block tables and pins"
        if self.offload is not None:
            self.offload.check_integrity()
