"""The KV pool's lower tiers and the copies between them (engine.proto's BlockCopies).

    KV pool    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (the device)
    host tier  [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    disk tier  the host tier's layout, in a file under --kv-offload-dir (memory-mapped)

A lower tier holds a block contiguously, so it moves as one span to and from the disk. The
scheduler decides (scheduler/kv_offload.py); the engine runs a plan's copies in order before its
forward: on a CPU at once, on a GPU on a copy stream with the host tier pinned, copies into the
pool overlapping the forward (docs/architecture.md#kv-tiers-copies-in-the-plan).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from llmserve.common.step_plan import BlockCopies
from llmserve.engine.contract.mirror import MirrorMismatch
from llmserve.protos import engine_pb2

DEVICE, HOST, DISK = engine_pb2.KV_TIER_DEVICE, engine_pb2.KV_TIER_HOST, engine_pb2.KV_TIER_DISK


def _disk_tier(directory: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of shape in a file made under directory, memory-mapped; the file is unlinked at
    once (the mapping keeps it), so nothing is left behind when the process ends."""
    element = torch.empty(0, dtype=dtype).element_size()
    num_bytes = max(1, element * int(torch.Size(shape).numel()))
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="llmserve-kv-", suffix=".bin", dir=directory)
    try:
        os.ftruncate(fd, num_bytes)  # sparse: disk is used as blocks are written
        mapped = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    finally:
        os.close(fd)
        os.unlink(path)
    return mapped.view(dtype).view(shape)


class KVTiers:
    """The host tier (num_host_blocks slots) and the disk tier (num_disk_blocks, in a file
    under disk_dir) under kv_cache, and `execute`, which runs a plan's copies."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_host_blocks: int,
        num_disk_blocks: int = 0,
        disk_dir: str | None = None,
    ):
        assert num_host_blocks > 0 and (num_disk_blocks == 0 or disk_dir)
        self.kv_cache = kv_cache
        layers, kv, _, *block = kv_cache.shape
        slot_shape = (layers, kv, *block)
        self.device = kv_cache.device
        pinned = self.device.type == "cuda"
        self.host = torch.zeros(
            (num_host_blocks, *slot_shape), dtype=kv_cache.dtype, pin_memory=pinned
        )
        self.disk: torch.Tensor | None = None
        if num_disk_blocks:
            assert disk_dir is not None
            self.disk = _disk_tier(disk_dir, (num_disk_blocks, *slot_shape), kv_cache.dtype)
        self.stream: Any = torch.cuda.Stream(self.device) if pinned else None
        self.inbound_done: Any = None  # the last plan's copies into the pool (GPU)
        self.host_written: Any = None  # the last plan's copies into the host tier (GPU)

    @property
    def num_host_blocks(self) -> int:
        return self.host.shape[0]

    @property
    def num_disk_blocks(self) -> int:
        return 0 if self.disk is None else self.disk.shape[0]

    def check(self, copies: list[BlockCopies]) -> None:
        """Raise MirrorMismatch (the plan is refused whole) for a copy between tiers this
        engine lacks, of a kind it does not run, or naming a block outside its tier."""
        sizes = {DEVICE: self.kv_cache.shape[2], HOST: self.num_host_blocks}
        if self.disk is not None:
            sizes[DISK] = self.num_disk_blocks
        for batch in copies:
            kind = (batch.src_tier, batch.dst_tier)
            if kind not in ((HOST, DISK), (DEVICE, HOST), (HOST, DEVICE), (DISK, DEVICE)):
                raise MirrorMismatch(f"no such KV copy: tier {kind[0]} -> tier {kind[1]}")
            if len(batch.src_ids) != len(batch.dst_ids):
                raise MirrorMismatch(
                    f"KV copy {kind}: {len(batch.src_ids)} sources, {len(batch.dst_ids)} "
                    "destinations"
                )
            for tier, ids in ((batch.src_tier, batch.src_ids), (batch.dst_tier, batch.dst_ids)):
                bad = [i for i in ids if not 0 <= i < sizes.get(tier, 0)]
                if bad:
                    raise MirrorMismatch(
                        f"KV copy {kind}: block {bad[0]} outside tier {tier}'s "
                        f"{sizes.get(tier, 0)} blocks"
                    )

    def execute(self, copies: list[BlockCopies]) -> None:
        """Run a plan's copies, in order, before its forward is launched (call it for every
        plan, with or without copies: on a GPU the forward waits here for what it must).
        Checks them all first (`check`)."""
        self.check(copies)
        if self.stream is None:
            for batch in copies:
                self._copy(batch)
            return
        current = torch.cuda.current_stream(self.device)
        if self.inbound_done is not None:
            current.wait_event(self.inbound_done)  # last plan's blocks, read from this step on
            self.inbound_done = None
        if not copies:
            return
        self.stream.wait_stream(current)
        outbound_done = None
        with torch.cuda.stream(self.stream):
            for batch in copies:
                if batch.dst_tier == DEVICE and outbound_done is None:
                    outbound_done = self.stream.record_event()
                if batch.dst_tier == DISK and self.host_written is not None:
                    self.host_written.synchronize()  # the CPU reads host slots written async
                self._copy(batch)
                if batch.dst_tier == HOST:
                    self.host_written = self.stream.record_event()
            self.inbound_done = self.stream.record_event()
        current.wait_event(outbound_done or self.inbound_done)

    def _copy(self, batch: BlockCopies) -> None:
        """One batch: every block's layers, keys and values, source to destination."""
        src = torch.tensor(batch.src_ids, dtype=torch.long)
        dst = torch.tensor(batch.dst_ids, dtype=torch.long)
        kind = (batch.src_tier, batch.dst_tier)
        if kind == (DEVICE, HOST):
            self._device_to_host(src, dst)
        elif kind == (HOST, DEVICE):
            self._to_device(self.host, src, dst)
        elif kind == (HOST, DISK) and self.disk is not None:
            self.disk[dst] = self.host[src]
        elif self.disk is not None:  # (DISK, DEVICE): `check` let no other through
            self._to_device(self.disk, src, dst)

    def _device_to_host(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        # [layers, 2, n, ...] gathered on the device, then block by block into the host slots
        # (a slot is contiguous: pinned memory takes an asynchronous copy).
        blocks = self.kv_cache[:, :, src.to(self.device)].movedim(2, 0)
        if self.stream is None:
            self.host[dst] = blocks
            return
        blocks = blocks.contiguous()
        for i, slot in enumerate(dst.tolist()):
            self.host[slot].copy_(blocks[i], non_blocking=True)

    def _to_device(self, tier: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self.stream is None:
            self.kv_cache[:, :, dst] = tier[src].movedim(0, 2)
            return
        for slot, block_id in zip(src.tolist(), dst.tolist(), strict=True):
            self.kv_cache[:, :, block_id].copy_(tier[slot], non_blocking=True)
