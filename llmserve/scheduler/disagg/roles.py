"""The scheduler service's engines under prefill / decode disaggregation (docs/disaggregation.md):
N prefill engines and M decode engines, each driven by its own EngineLink with its own Scheduler
over that engine's pool, all on the service's one asyncio loop. `Roles` holds the links by role
and makes the decisions that span engines (each between two awaits, so no locking): which
prefill engine takes a prompt, which decode engine takes a handoff (prefix affinity within
AFFINITY_SLACK of the least busy), and where a lost engine's requests go. Nothing already
streamed is streamed again. The rules: docs/disaggregation.md#how-a-request-runs and #failures.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from llmserve.common.log import get_logger
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.engine_link import EngineLink, LinkEvents

log = get_logger("scheduler")

# Each engine's Scheduler numbers its steps from link index << STEP_ID_SHIFT (the service's
# telemetry keys steps in flight by id), and its transfers from index << TRANSFER_ID_SHIFT (so
# an id names one transfer in the logs of every engine).
STEP_ID_SHIFT = 40
TRANSFER_ID_SHIFT = 32
# A request's prefix affinity yields to load when its decode engine holds more than this many
# requests beyond the least busy one.
AFFINITY_SLACK = 4


def load(scheduler: Scheduler) -> int:
    """Requests a scheduler holds: running, waiting, and (decode) waiting for their KV."""
    return len(scheduler.running) + scheduler.num_waiting + len(scheduler.transfers.in_flight)


def queued_prompt_tokens(scheduler: Scheduler) -> int:
    """Prompt tokens a (prefill) scheduler has still to compute."""
    requests = [*scheduler.running, *scheduler.waiting]
    return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in requests)


def pick_prefill(schedulers: Sequence[Scheduler]) -> int | None:
    """The index of the prefill scheduler a new request's prompt goes to: the fewest prompt
    tokens queued, then the fewest requests, then the first. None for none."""
    if not schedulers:
        return None
    keys = [(queued_prompt_tokens(s), load(s), i) for i, s in enumerate(schedulers)]
    return min(keys)[2]


def pick_decode(schedulers: Sequence[Scheduler], request: Request, num_blocks: int) -> int | None:
    """The index of the decode scheduler request (its prompt's num_blocks full blocks computed
    on a prefill engine) moves to: among those with room for the blocks they lack, and no
    busier than the least busy by more than AFFINITY_SLACK requests, the one whose prefix cache
    holds most of its prompt, then the least busy, then the first. None for none."""
    if not schedulers:
        return None
    loads = [load(s) for s in schedulers]
    least = min(loads)
    keys = []
    # Hashed by the pools' block size (the candidates' is the prefill engine's: Roles.hand_off),
    # once for all of them.
    request.block_hashes = []
    for i, s in enumerate(schedulers):
        cached = len(s.block_manager.find_cached_blocks(request)) if num_blocks else 0
        room = s.block_manager.num_free_blocks >= num_blocks - cached
        keys.append((not room, loads[i] > least + AFFINITY_SLACK, -cached, loads[i], i))
    request.block_hashes = []
    return min(keys)[-1]


class Roles:
    """The service's engines by role, and the decisions that span them (module docstring)."""

    def __init__(self, first: EngineLink, events: LinkEvents):
        """first: the first decode engine's link; the others are made here, sharing its
        config, streams and telemetry, reporting to events (the service)."""
        config = first.config

        def link(role: str, address: str) -> EngineLink:
            return EngineLink(config, role, address, first.streams, first.telemetry, events)

        self.decodes = [first, *(link("decode", a) for a in config.engine_address[1:])]
        self.prefills = [link("prefill", a) for a in config.prefill_engine_address]

    @property
    def links(self) -> list[EngineLink]:
        return [*self.decodes, *self.prefills]

    def first_ids(self, link: EngineLink, scheduler: Scheduler) -> None:
        """A new Scheduler of link: its step and transfer ids start at link's index."""
        index = self.links.index(link)
        scheduler.next_step_id = max(scheduler.next_step_id, index << STEP_ID_SHIFT)
        scheduler.transfers.ids = itertools.count((index << TRANSFER_ID_SHIFT) + 1)

    def connected(self) -> bool:
        """Every engine has been up once (its Step stream open: connected, its configured
        adapters loaded), so the first requests find every engine."""
        return all(link.been_ready for link in self.links)

    def any_up(self) -> bool:
        return any(link.up for link in self.links)

    def up(self, links: list[EngineLink]) -> list[EngineLink]:
        return [link for link in links if link.up]

    def submit_target(self) -> Scheduler | None:
        """Where a new request starts: a prefill engine that takes requests, else a decode
        engine up (which runs it whole); None when no engine is up."""
        prefills = self._schedulers(self.up(self.prefills))
        if prefills:
            return prefills[pick_prefill(prefills) or 0]
        decodes = self._schedulers(self.up(self.decodes))
        return min(decodes, key=load) if decodes else None

    @staticmethod
    def _schedulers(links: list[EngineLink]) -> list[Scheduler]:
        return [link.scheduler for link in links if link.scheduler is not None]

    def wake(self) -> None:
        for link in self.links:
            link.wakeup.set()

    # -- a prefill engine's result: its requests with a first token move to decode engines ----

    def hand_off(self, link: EngineLink) -> None:
        """The requests of prefill link whose first token came go to decode engines: each
        chosen one pins blocks for what its prefix cache lacks, and the send goes in link's
        next plan."""
        prefill = link.scheduler
        assert prefill is not None
        handoffs = prefill.handoffs.take()
        if not handoffs:
            return
        up = [d for d in self.up(self.decodes) if self._same_blocks(d, prefill)]
        for request, blocks in handoffs:
            chosen = self._decode_for(request, blocks, up)
            decode = chosen.scheduler
            assert decode is not None and chosen.engine_info is not None
            address = chosen.engine_info.kv_transfer_address if chosen in up else ""
            to_send = decode.handoffs.receive(
                request, blocks if address else [], source=link.address
            )
            if to_send:
                transfer_id = decode.transfers.by_seq_id[request.seq_id]
                prefill.handoffs.queue_send(transfer_id, to_send, address)
            chosen.wakeup.set()
        link.wakeup.set()

    def _decode_for(self, request: Request, blocks: list[int], up: list[EngineLink]) -> EngineLink:
        """The decode engine request moves to: pick_decode among those up (with the
        prefill's block size); with none, the least busy connected one (it waits there)."""
        if up:
            schedulers = self._schedulers(up)
            return up[pick_decode(schedulers, request, len(blocks)) or 0]
        known = [d for d in self.decodes if d.scheduler is not None]
        assert known, "a prefill engine ran before any decode engine connected"
        return min(known, key=lambda d: load(d.scheduler))  # type: ignore[arg-type]

    @staticmethod
    def _same_blocks(decode: EngineLink, prefill: Scheduler) -> bool:
        info = decode.engine_info
        return (
            info is not None
            and bool(info.kv_transfer_address)
            and info.block_size == prefill.block_size
        )

    # -- an engine lost, or back ----------------------------------------------------------------

    def lost(self, link: EngineLink) -> None:
        """link's engine was lost (its Scheduler reset: every request of it waits)."""
        if link in self.prefills:
            self._prefill_lost(link)
        else:
            self._decode_lost(link)

    def _prefill_lost(self, link: EngineLink) -> None:
        """Its transfers in flight are given up (their requests recompute on their decode
        engines); its requests go to another prefill engine, else a decode engine."""
        scheduler = link.scheduler
        assert scheduler is not None
        scheduler.transfers.forget_plan_parts()
        failed = [
            request
            for decode in self._schedulers(self.decodes)
            for request in decode.handoffs.fail("prefill_lost", source=link.address)
        ]
        moved = list(scheduler.waiting)
        for request in moved:
            scheduler.handoffs.release(request)
            self._new_home(request).handoffs.receive(request, [])
        if failed or moved:
            log.warning(
                "prefill engine lost: its requests move to other engines",
                engine_address=link.address,
                num_transfers_failed=len(failed),
                num_requests_moved=len(moved),
            )
        self.wake()

    def _new_home(self, request: Request) -> Scheduler:
        """Where a request of a lost prefill engine goes: one with no token yet, where a new
        request would; one with tokens (it ran whole there), a decode engine that is up, else
        where a new request would. Failing those, the least busy decode engine (it waits)."""
        decodes = self._schedulers(self.up(self.decodes))
        if request.num_output_tokens and decodes:
            return min(decodes, key=load)
        target = self.submit_target()
        if target is not None:
            return target
        known = self._schedulers(self.decodes)
        assert known, "no decode engine connected"
        return min(known, key=load)

    def _decode_lost(self, link: EngineLink) -> None:
        """Its requests go to another decode engine up (recomputed there); with none, a
        prefill engine runs them, and new ones, whole until one is back. Sends queued for it
        are dropped (their transfers ended with its pool)."""
        scheduler = link.scheduler
        assert scheduler is not None
        address = link.engine_info.kv_transfer_address if link.engine_info else ""
        for prefill in self._schedulers(self.prefills):
            sends = prefill.transfers.sends
            prefill.transfers.sends = [s for s in sends if s.address != address]
        others = self._schedulers([d for d in self.up(self.decodes) if d is not link])
        takers = self._schedulers(self.up(self.prefills))
        if not others:
            for prefill in takers:
                prefill.transfers.role = "both"
        targets = others or takers
        if not targets:
            return  # nobody can take them: they wait for an engine
        moved = list(scheduler.waiting)
        for request in moved:
            scheduler.handoffs.release(request)
            min(targets, key=load).handoffs.receive(request, [])
        log.warning(
            "decode engine lost: its requests move to "
            + ("other decode engines" if others else "the prefill engines, run whole"),
            engine_address=link.address,
            num_requests_moved=len(moved),
        )
        self.wake()

    def back(self, link: EngineLink) -> None:
        """link's engine is (back) up. A decode engine: prefill engines that ran requests
        whole hand prompts off again (what they already sampled for finishes there). A
        prefill engine while no decode engine is up: it runs requests whole."""
        if link in self.decodes:
            for prefill in self._schedulers(self.prefills):
                prefill.transfers.role = "prefill"
        elif not self.up(self.decodes) and link.scheduler is not None:
            link.scheduler.transfers.role = "both"

    def health_changed(self) -> None:
        """A decode engine counts as up only once it is ready (its configured adapters loaded,
        after `back`), so readiness, not only `back`, returns prefill engines that ran requests
        whole to handing prompts off: a prefill engine that connected while the decode engine
        was connecting but not yet ready would otherwise run every request whole for good."""
        if self.up(self.decodes):
            for prefill in self._schedulers(self.prefills):
                prefill.transfers.role = "prefill"
