"""KV offload in planning: a waiting request whose cached prefix continues in a lower tier waits
one plan while its blocks come back (`_start_swap_in`), and swap preemption copies a victim's
blocks down before anyone reuses them (`_swap_out`). The tiers' index and the copies are
scheduler/kv_offload.py's; the block manager hands it evicted blocks.

A swap-in, for the request first in line:

    plan N:    its device hits and fresh blocks for its lower-tier hits are pinned for it (held,
               not in its block table); the copies back to the device travel in plan N, which
               admits nobody else (the running requests step as usual)
    plan N+1:  the prefix cache finds the whole prefix on the device; it is admitted as on any
               hit and the pins are dropped. The engine has run plan N's copies by the time plan
               N+1's forward reads them.
"""

from __future__ import annotations

import time

from llmserve.scheduler.request import Request
from llmserve.scheduler.state import SchedulerState
from llmserve.scheduler.disagg.transfers import KVMove


class Offloading(SchedulerState):
    def _start_swap_in(self, request: Request, cached: list[int]) -> bool:
        """If request's prefix goes on past its device hits (cached) in a lower tier, bring
        those blocks back (as many as free blocks allow; a block already on the device ends the
        run) and return True: request waits for the next plan. False, changing nothing, when
        there is nothing to bring back."""
        bm, offload = self.block_manager, self.block_manager.offload
        if offload is None:
            return False
        keys = bm.keys_after(request, len(cached))
        hits = offload.find(keys)
        if not hits:
            return False
        on_device = next((i for i, k in enumerate(keys) if k[0] in bm.hash_to_block), len(keys))
        room = bm.num_free_blocks - sum(1 for b in cached if bm.ref_cnt[b] == 0)
        hits = hits[: max(0, min(on_device, room))]
        if not hits:
            return False
        offload.lock(hits)  # before pin_new's evictions may want their slots
        bm.pin(request.seq_id, cached)
        for hit, block_id in zip(hits, bm.pin_new(request.seq_id, keys[: len(hits)]), strict=True):
            offload.bring_back(hit, block_id)
        request.swap_in_since = request.swap_in_since or time.monotonic()
        return True

    def _release_pins(self) -> bool:
        """Give back every block pinned for a swap-in (a running request needs blocks: they go
        before anyone is preempted). They stay cached on the device until reused; a request
        that waited for them finds them there, or swaps in again. False if none was pinned."""
        holders = [h for h in self.block_manager.pins if self.transfers.of(h) is None]
        for holder in holders:  # blocks a KV transfer is filling stay pinned
            self.block_manager.unpin(holder)
        return bool(holders)

    def _end_swap_in(self, request: Request) -> None:
        """request was admitted (it holds its blocks) or ended: drop its pins, count its wait."""
        blocks = len(self.block_manager.pins.get(request.seq_id, []))  # its prefix, held
        self.block_manager.unpin(request.seq_id)
        offload = self.block_manager.offload
        if request.swap_in_since and offload is not None:
            waited = time.monotonic() - request.swap_in_since
            offload.counters.num_swap_ins += 1
            offload.counters.swap_in_wait_s += waited
            self.transfers.moves.append(
                KVMove("swap_in", request, waited, blocks, blocks * offload.block_bytes)
            )
        request.swap_in_since = 0.0

    def _swap_out(self, request: Request) -> None:
        """Swap preemption: copy running request's full blocks of computed tokens down to the
        host tier now (those it holds already cost nothing), before its blocks are freed. The
        KV of tokens planned in steps still in flight is written by those steps, which the
        engine runs before this plan's copies."""
        offload = self.block_manager.offload
        if offload is None or self.config.preemption_mode != "swap":
            return
        num_known = min(request.num_computed_tokens, len(request.token_ids))
        self.block_manager.cache_full_blocks(request, num_known)
        for block_id, key in self.block_manager.cached_blocks_of(request):
            offload.store(block_id, key)
