"""The recurrent-state pool of a hybrid linear-attention model, beside the KV pool: for every
state layer (ModelConfig.state_layout, common/state_layout.py) and every slot,

    conv       [num_state_layers, num_state_slots, *conv_shape]       e.g. [C, conv_kernel - 1]
    recurrent  [num_state_layers, num_state_slots, *recurrent_shape]  e.g. [H, Dk, Dv], fp32

Slot ids are the scheduler's (NewRequest.state_slot, scheduler/state_slots.py); a layer reads
its request's slot at the start of a step's chunk and writes it back at the chunk's end. A
request's first chunk (num_computed_tokens 0) starts from zeros whatever the slot held. The
slots after the request slots hold state snapshots (the prefix cache's: `copy` fills them after
a forward and restores a request's slot from one before it).
`StateBatch` is one step's view: the pool and each row's slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmserve.common.model_config import ModelConfig
from llmserve.engine.kv.cache import zeroed

RECURRENT_DTYPE = torch.float32  # kernels/gated_delta.cu's (and ssd_step.cu's) state


def state_bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
    """One slot's bytes over all state layers (0 for a model without them): the conv state in
    the model's dtype, the recurrent state in float32."""
    layout = config.state_layout
    if layout is None:
        return 0
    element = torch.empty(0, dtype=dtype).element_size()
    per_layer = math.prod(layout.conv_shape) * element + math.prod(layout.recurrent_shape) * 4
    return config.num_state_layers * per_layer


class StatePool:
    """The pool's two tensors, zeroed (on a CPU lazily, as the KV pool: resident memory grows
    with the slots used). The recurrent state is float32 whatever the model's dtype: it is
    decayed and added to at every token, and the CUDA kernels read and write it so."""

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshot_slots: int = 0,
    ):
        """num_slots request slots, then num_snapshot_slots snapshot slots (ids num_slots ..)."""
        layout = config.state_layout
        assert layout is not None and num_slots > 0, "a state pool for a model without state"
        n, total = config.num_state_layers, num_slots + num_snapshot_slots
        self.num_slots, self.num_snapshot_slots = num_slots, num_snapshot_slots
        self.conv = zeroed((n, total, *layout.conv_shape), dtype, device)
        self.recurrent = zeroed((n, total, *layout.recurrent_shape), RECURRENT_DTYPE, device)

    @torch.inference_mode()
    def copy(self, src_slots: list[int], dst_slots: list[int]) -> None:
        """Every state layer's slot src_slots[i] into slot dst_slots[i], in list order (a
        snapshot taken, or a request's slot restored from one)."""
        for src, dst in zip(src_slots, dst_slots, strict=True):
            self.conv[:, dst].copy_(self.conv[:, src])
            self.recurrent[:, dst].copy_(self.recurrent[:, src])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))


@dataclass
class StateBatch:
    """One step's rows' slots in the pool (pool None: a step with no pool behind it, the
    memory profile's, whose rows start from zeros and keep nothing)."""

    pool: StatePool | None
    slots: list[int]

    def read(self, layer: int, row: int, fresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, recurrent) state of row's request in state layer `layer`: zeros for a fresh
        request (its first chunk), else a copy of its slot's."""
        pool = self.pool
        assert pool is not None
        slot = self.slots[row]
        conv, rec = pool.conv[layer, slot], pool.recurrent[layer, slot]
        if fresh:
            return torch.zeros_like(conv), torch.zeros_like(rec)
        return conv.clone(), rec.clone()

    def gather_conv(self, layer: int, rows: list[int]) -> torch.Tensor:
        """[B, ...]: copies of rows' conv states in state layer `layer` (rows running on, never
        fresh: a step's decode rows, taken together)."""
        pool = self.pool
        assert pool is not None
        return pool.conv[layer, self.slot_ids(rows, pool.conv.device)]

    def scatter_conv(self, layer: int, rows: list[int], conv: torch.Tensor) -> None:
        """rows' new conv states (as gather_conv returned them, [B, ...]) into their slots."""
        pool = self.pool
        assert pool is not None
        pool.conv[layer, self.slot_ids(rows, pool.conv.device)] = conv.to(pool.conv.dtype)

    def recurrent(self, layer: int) -> torch.Tensor:
        """State layer `layer`'s recurrent states, every slot ([slots, ...], a view: the decode
        ops update rows' slots in it in place)."""
        assert self.pool is not None
        return self.pool.recurrent[layer]

    def slot_ids(self, rows: list[int], device: torch.device) -> torch.Tensor:
        """rows' slots, int64 on `device`."""
        return torch.tensor([self.slots[r] for r in rows], device=device)

    def write(self, layer: int, row: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Row's state after its chunk, into its slot (nothing without a pool)."""
        if self.pool is not None:
            slot = self.slots[row]
            self.pool.conv[layer, slot].copy_(conv)
            self.pool.recurrent[layer, slot].copy_(recurrent)
