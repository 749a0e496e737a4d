"""Prefill / decode disaggregation's bookkeeping (docs/disaggregation.md): the KV transfers in
flight into a decode engine's pool, the parts of the next plans that carry them, and their
counters. scheduler/disagg/handoffs.py holds the decisions; this holds what they leave.

A transfer's life, on the decode side:

    started   fresh decode blocks pinned for the request (held, not in its block table, not in
              the prefix cache), a receive in the decode plan, a send in the prefill plan
    done      the decode engine reports it: the blocks enter the prefix cache under the
              prompt's keys and the request waits to be admitted, where they are a prefix hit
    failed    deadline passed, either engine lost, or cancelled: the pins are dropped (the
              blocks are free, never cached), a cancel goes in the decode plan, and the request
              waits to be admitted as a miss (recompute), unless it was cancelled
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from llmserve.scheduler.kv_offload import BlockKey
from llmserve.scheduler.request import Request

ROLES = ("both", "prefill", "decode")
FAILURES = ("deadline", "dropped", "prefill_lost", "decode_lost", "cancelled")


@dataclass
class Transfer:
    transfer_id: int
    request: Request
    block_ids: list[int]  # the decode pool's blocks it fills, in the prompt's order
    keys: list[BlockKey]  # those blocks' prefix-cache keys
    started: float  # time.monotonic()
    deadline: float
    source: str = ""  # the sending prefill engine's gRPC address


@dataclass(frozen=True)
class KVMove:
    """A request's KV that finished moving (or failed to), for the metrics and its span:
    kind "transfer" (prefill -> decode engine) or "swap_in" (a lower tier -> the device);
    seconds from start to end; outcome "done" or a failure reason."""

    kind: str
    request: Request
    seconds: float
    num_blocks: int
    num_bytes: int
    outcome: str = "done"


@dataclass
class TransferCounters:
    """Cumulative since start; GetStats and the metrics read them."""

    num_started: int = 0
    num_done: int = 0
    num_failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURES, 0))
    num_blocks: int = 0  # moved by transfers done
    seconds: float = 0.0  # handoff to arrival, summed over transfers done


class TransferTable:
    """One scheduler's side of disaggregation: its role, the transfers in flight into its pool
    (decode), and the plan parts waiting for the next plan (sends: prefill; receives and
    cancels: decode)."""

    def __init__(self, role: str = "both", timeout_s: float = 2.0):
        assert role in ROLES, role
        self.role = role
        self.timeout_s = timeout_s
        self.block_bytes = 0  # one block's bytes (the engine's kv_block_bytes)
        self.in_flight: dict[int, Transfer] = {}
        self.by_seq_id: dict[int, int] = {}
        # Plan parts not sent yet: (transfer id, block ids, address), (transfer id, block ids),
        # transfer ids.
        self.sends: list[tuple[int, list[int], str]] = []
        self.receives: list[tuple[int, list[int]]] = []
        self.cancels: list[int] = []
        # Prefill side: requests whose first token came, with their prompt's full blocks here.
        self.handoffs: list[tuple[Request, list[int]]] = []
        self.counters = TransferCounters()
        self.ids = itertools.count(1)
        # Moves ended since the telemetry last took them (transfers here, swap-ins too).
        self.moves: list[KVMove] = []

    @property
    def has_work(self) -> bool:
        """Whether a plan must go out for transfers alone: one is awaited (the decode engine is
        polled), or a send or cancel waits for a plan."""
        return bool(self.in_flight or self.sends or self.receives or self.cancels)

    def start(self, transfer: Transfer) -> None:
        self.in_flight[transfer.transfer_id] = transfer
        self.by_seq_id[transfer.request.seq_id] = transfer.transfer_id
        self.receives.append((transfer.transfer_id, transfer.block_ids))
        self.counters.num_started += 1

    def of(self, seq_id: int) -> Transfer | None:
        """The transfer request seq_id waits for, if any."""
        transfer_id = self.by_seq_id.get(seq_id)
        return self.in_flight.get(transfer_id) if transfer_id is not None else None

    def end(self, transfer: Transfer, failure: str | None, now: float) -> None:
        """transfer is done (failure None) or failed for reason failure: forget it; a failed
        one's receive is cancelled (a receive not sent yet is dropped, and the cancel still
        goes out: the engine then drops the blocks if they arrive)."""
        del self.in_flight[transfer.transfer_id]
        del self.by_seq_id[transfer.request.seq_id]
        num_blocks = len(transfer.block_ids)
        seconds, num_bytes = now - transfer.started, num_blocks * self.block_bytes
        move = KVMove("transfer", transfer.request, seconds, num_blocks, num_bytes)
        self.moves.append(move if failure is None else replace(move, outcome=failure))
        c = self.counters
        if failure is None:
            c.num_done += 1
            c.num_blocks += len(transfer.block_ids)
            c.seconds += now - transfer.started
            return
        c.num_failed[failure] += 1
        self.receives = [r for r in self.receives if r[0] != transfer.transfer_id]
        self.cancels.append(transfer.transfer_id)

    def take_plan_parts(
        self,
    ) -> tuple[list[tuple[int, list[int], str]], list[tuple[int, list[int]]], list[int]]:
        """The sends, receives and cancels decided since the last plan (and forget them)."""
        parts = (self.sends, self.receives, self.cancels)
        self.sends, self.receives, self.cancels = [], [], []
        return parts

    def forget_plan_parts(self) -> None:
        """The engine restarted: parts for its old stream mean nothing to the new one."""
        self.take_plan_parts()

    def stats(self) -> dict[str, object]:
        """The counters as GetStats names them (scheduler.proto's kv_transfer fields)."""
        c = self.counters
        return {
            "num_kv_transfers": c.num_started,
            "num_kv_transfers_done": c.num_done,
            "num_kv_transfers_failed": dict(c.num_failed),
            "kv_transfer_blocks": c.num_blocks,
            "kv_transfer_bytes": c.num_blocks * self.block_bytes,
            "kv_transfer_s": c.seconds,
            "num_transferring": len(self.in_flight),
        }
