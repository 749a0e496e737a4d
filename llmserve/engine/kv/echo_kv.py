"""The echo engine's (engine/contract/echo.py) KV pool, when it has a role in prefill / decode
disaggregation: DIGEST_BYTES per block, a digest of the request's tokens up to the block's end,
written by the step that completes the block, moved through engine/kv/disaggregation.py's
KVTransfers exactly as the real engine's pool. A request added with computed tokens (on a decode
engine, the blocks a transfer moved) has each block checked against its digest, so a transfer
written into the wrong blocks, or not at all, is a MirrorMismatch. ModelledLink holds each send
until the KV it stands for would have crossed the link. See
docs/disaggregation.md#a-model-of-the-gpu-case.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Iterator

import torch

from llmserve.common.step_plan import StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.mirror import MirrorMismatch, ScheduledSeq
from llmserve.engine.kv.disaggregation import KVTransfers

DIGEST_BYTES = 8  # what a block holds (and moves)


class ModelledLink:
    """One link between a prefill and a decode engine, one transfer at a time."""

    def __init__(self, block_bytes: int, gb_per_s: float):
        assert block_bytes > 0 and gb_per_s > 0, (block_bytes, gb_per_s)
        self.block_bytes = block_bytes
        self.bytes_per_s = gb_per_s * 1e9
        self.free_at = 0.0  # when the last send handed to it has crossed (time.monotonic())

    def seconds(self, num_blocks: int) -> float:
        """How long num_blocks take on the link alone."""
        return num_blocks * self.block_bytes / self.bytes_per_s

    def arrival(self, num_blocks: int) -> float:
        """A send of num_blocks handed off now: when it has crossed (and the link is free)."""
        self.free_at = max(time.monotonic(), self.free_at) + self.seconds(num_blocks)
        return self.free_at


class EchoKV:
    """The pool of digests and its transfers (KVTransfers over it, by config's engine role).
    block_bytes: the KV bytes a block stands for (0: DIGEST_BYTES); gb_per_s: the modelled
    link's bandwidth for sends (0: none, they leave at once)."""

    def __init__(
        self, config: EngineConfig, num_blocks: int, block_bytes: int = 0, gb_per_s: float = 0.0
    ):
        self.block_size = config.block_size
        self.block_bytes = block_bytes or DIGEST_BYTES
        self.pool = torch.zeros((1, 1, num_blocks, DIGEST_BYTES), dtype=torch.uint8)
        self.transfers = KVTransfers.for_engine(self.pool, config)
        if gb_per_s:
            self.transfers.link = ModelledLink(self.block_bytes, gb_per_s).arrival

    @property
    def address(self) -> str:
        return self.transfers.address

    def launch(self, plan: StepPlanData) -> None:
        """plan's sends, cancels and receives (KVTransfers' send and receive: before the mirror
        update)."""
        self.transfers.send(plan)
        self.transfers.receive(plan)

    def report(self) -> tuple[list[int], list[int]]:
        """At a step's result: the transfers written (arrived ones now) and failed since the
        last result (KVTransfers.report)."""
        return self.transfers.report()

    def check(self, row: ScheduledSeq) -> None:
        """A new request's computed blocks hold its own tokens' digests; MirrorMismatch if not."""
        seq = row.seq
        for k, digest in _digests(seq.token_ids, self.block_size, 0, row.start // self.block_size):
            held = bytes(self.pool[0, 0, seq.block_table[k]].numpy())
            if held != digest:
                raise MirrorMismatch(
                    f"seq {seq.seq_id}: block {seq.block_table[k]} (its block {k} of "
                    f"{row.start // self.block_size} computed) holds other KV than its tokens' "
                    "(a transfer into other blocks, or none)"
                )

    def write(self, row: ScheduledSeq) -> None:
        """The digests of the blocks row's step completes:

        |<- computed ->|<- scheduled now ->|
        |  k  |  k  |  k  |  k  |  k  |   (blocks wholly below end, not wholly below start)
        """
        seq, size = row.seq, self.block_size
        for k, digest in _digests(seq.token_ids, size, row.start // size, row.end // size):
            self.pool[0, 0, seq.block_table[k]] = torch.frombuffer(
                bytearray(digest), dtype=torch.uint8
            )

    def reset(self) -> None:
        self.transfers.reset()

    def close(self) -> None:
        self.transfers.close()


def _digests(
    token_ids: list[int], block_size: int, first: int, last: int
) -> Iterator[tuple[int, bytes]]:
    """(k, the digest of token_ids[: (k + 1) * block_size]) for k in [first, last)."""
    chain = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for k in range(last):
        chain.update(array("q", token_ids[k * block_size : (k + 1) * block_size]).tobytes())
        if k >= first:
            yield k, chain.digest()
