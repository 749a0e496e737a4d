"""Batched LoRA in the engine: the device-resident slot table of adapters (LoraSlots) and the
per-step segmented low-rank products over the rows that use them (LoraBatch). The scheduler
picks the slots (scheduler/lora.py); the reference products are kernels/lora_reference.py.

A step's rows are grouped by slot into segments; each projection adds, per segment, shrink
(x A^T) then expand (B), padded into one batched matmul for decode-like steps, one matmul pair
per segment for a long prefill, kernels/lora.cu on a GPU with the CUDA kernels, and
kernels/cpu_lora.cpp on a CPU in float32 (per row in a fixed order, so a request's tokens do
not depend on its neighbours). The adapter is never merged into the base weight.
See docs/lora.md#how-a-step-runs.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve.common.model_config import ModelConfig
from llmserve.engine.features.lora_files import LoraAdapter, module_shapes
from llmserve.engine.parallel.groups import ModelShard
from llmserve.kernels.cpu_lora import lora_rows
from llmserve.kernels.cpu_lora import unavailable as cpu_lora_unavailable
from llmserve.kernels.lora_reference import Select, lora_padded, lora_segments
from llmserve.kernels.lora_reference import lora_add as lora_add_reference

# kernels.lora_add's signature: (x, out, slot_ids, a, b, rank) -> out, updated in place.
LoraKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], int], torch.Tensor
]

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
GROUP_OF = {module: group for group, modules in GROUPS.items() for module in modules}
ROW_PARALLEL = ("o_proj", "down_proj")


def local_shapes(config: ModelConfig, tp_size: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each module on one of tp_size ranks: column-parallel ones split their
    output, row-parallel ones their input."""
    shapes = {}
    for module, (out_features, in_features) in module_shapes(config).items():
        if module in ROW_PARALLEL:
            shapes[module] = (out_features, in_features // tp_size)
        else:
            shapes[module] = (out_features // tp_size, in_features)
    return shapes


class LoraSlots:
    """max_loras adapters resident on the device, one per slot, for this rank's layers.

    Slots are numbered 1 .. max_loras as the plan names them (0: the base model). For each
    projection group (GROUPS: qkv_proj adapts q, k and v; gate_up_proj gate and up) the table
    holds every slot's A of every part and B per part:

        a[group]     [num_layers, max_loras, max_rank, num_parts, in_features]
        b[group][p]  [num_layers, max_loras, max_rank, out_features of part p]

    Rank before part, so a slot's first r ranks of every part are one contiguous
    [r * parts, in] matrix and one product shrinks every part. Zero where an adapter has a
    lower rank or does not adapt a module, so a zero slice adds nothing. Under tensor
    parallelism A and B are split as their base layer is: column-parallel modules (q, k, v,
    gate, up) keep this rank's rows of B, row-parallel ones (o, down) its columns of A.
    """

    def __init__(
        self,
        config: ModelConfig,
        shard: ModelShard,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """config: the whole model's shape; shard: this rank's layers and tensor split."""
        self.shard, self.max_loras, self.max_rank = shard, max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.shapes = local_shapes(config, shard.tp.size)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, list[torch.Tensor]] = {}
        # Per slot (index slot - 1): the adapter's name, rank and projections ("" / 0 / empty).
        self.names = [""] * max_loras
        self.ranks = [0] * max_loras
        self.groups: list[frozenset[str]] = [frozenset()] * max_loras

    def _allocate(self, group: str) -> None:
        """The group's stacks, zeros, on first use (an adapter set that never adapts the MLP
        costs no MLP table)."""
        layers, parts = len(self.shard.layers), GROUPS[group]
        in_features = self.shapes[parts[0]][1]
        shape = (layers, self.max_loras, self.max_rank, len(parts), in_features)
        self.a[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.b[group] = [
            torch.zeros(
                (layers, self.max_loras, self.max_rank, self.shapes[part][0]),
                dtype=self.dtype,
                device=self.device,
            )
            for part in parts
        ]

    def place(self, slot: int, adapter: LoraAdapter) -> None:
        """Put adapter in slot (1 .. max_loras), replacing what was there; the steps that run
        after this see it (on a GPU the copies are ordered on the stream after earlier steps)."""
        index = self._index(slot)
        groups = frozenset(GROUP_OF[m] for m in adapter.target_modules)
        for group in groups - self.a.keys():
            self._allocate(group)
        self._zero(index)
        tp, start = self.shard.tp, self.shard.layers.start
        for (layer, module), (a, b) in adapter.weights.items():
            if layer not in self.shard.layers:
                continue
            group = GROUP_OF[module]
            part = GROUPS[group].index(module)
            out_features, in_features = self.shapes[module]
            if module in ROW_PARALLEL:
                a = a.narrow(1, tp.rank * in_features, in_features)
            else:
                b = b.narrow(0, tp.rank * out_features, out_features)
            rank = a.shape[0]
            self.a[group][layer - start, index, :rank, part].copy_(a)
            self.b[group][part][layer - start, index, :rank].copy_(b.t())
        self.names[index], self.ranks[index], self.groups[index] = (
            adapter.name,
            adapter.rank,
            groups,
        )

    def clear(self, slot: int) -> None:
        """Empty slot: its rows would add nothing."""
        index = self._index(slot)
        self._zero(index)
        self.names[index], self.ranks[index], self.groups[index] = "", 0, frozenset()

    def _zero(self, index: int) -> None:
        for group, a in self.a.items():
            a[:, index].zero_()
            for b in self.b[group]:
                b[:, index].zero_()

    def _index(self, slot: int) -> int:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"lora slot {slot} is outside 1..max_loras={self.max_loras}")
        return slot - 1

    def batch(self, row_slots: list[int], row_tokens: list[int]) -> LoraBatch | None:
        """The step's LoRA layout from each row's slot (0: base) and token count, in the
        forward's row order; None when no row uses an adapter."""
        by_slot: dict[int, list[int]] = {}
        offset = 0
        for slot, num_tokens in zip(row_slots, row_tokens, strict=True):
            if slot:
                self._index(slot)
                by_slot.setdefault(slot, []).extend(range(offset, offset + num_tokens))
            offset += num_tokens
        if not by_slot:
            return None
        slots = sorted(by_slot)
        groups = frozenset().union(*(self.groups[s - 1] for s in slots))
        rank = max(self.ranks[s - 1] for s in slots)
        if not groups or rank == 0:
            return None
        segments, indices = [by_slot[s] for s in slots], [s - 1 for s in slots]
        return LoraBatch.build(self, segments, indices, rank, offset)


@dataclass
class LoraBatch:
    """One step's rows grouped by slot. `tokens`: the adapted tokens' indices in the forward,
    segment after segment; segment i is tokens[starts[i]:starts[i+1]], of stack index
    indices[i]. Padded layout (padded=True): segment i's token j sits at row i * longest + j of
    a [segments * longest] batch; `gather` names each row's token (0 for padding) and
    `positions` each token's row (each None where it is the identity: nothing to copy).
    `num_rows`: the forward's rows, adapted or not."""

    slots: LoraSlots
    groups: frozenset[str]
    rank: int
    tokens: torch.Tensor
    starts: list[int]
    indices: list[int]
    longest: int
    padded: bool
    gather: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    segment_list: list[tuple[int, int, int]] = field(default_factory=list)
    num_rows: int = 0
    token_list: list[int] = field(default_factory=list)
    select: Select = None  # the padded layout's slots (kernels/lora_reference.py)
    every_row: bool = False  # tokens is every row of the forward, in order
    _slot_ids: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        slots: LoraSlots,
        segments: list[list[int]],
        indices: list[int],
        rank: int,
        num_rows: int,
    ) -> LoraBatch:
        device = slots.device
        starts = [0]
        for tokens in segments:
            starts.append(starts[-1] + len(tokens))
        longest = max(len(t) for t in segments)
        # Padding multiplies the update's work by (segments x longest) / tokens: fine for decode
        # steps, not beside a long prefill chunk.
        padded = len(segments) * longest <= 2 * starts[-1] + 16
        flat = [t for tokens in segments for t in tokens]
        batch = cls(
            slots, frozenset().union(*(slots.groups[i] for i in indices)), rank,
            _tensor(flat, device), starts, indices, longest, padded,
        )  # fmt: skip
        batch.num_rows, batch.token_list = num_rows, flat
        batch.every_row = flat == list(range(num_rows))
        if padded:
            batch.select = _select(indices, slots.max_loras, device)
            gather = [0] * (len(segments) * longest)
            positions = []
            for i, tokens in enumerate(segments):
                rows = range(i * longest, i * longest + len(tokens))
                positions.extend(rows)
                for row, token in zip(rows, tokens, strict=True):
                    gather[row] = token
            if gather != list(range(num_rows)):
                batch.gather = _tensor(gather, device)
            if positions != list(range(len(gather))):
                batch.positions = _tensor(positions, device)
        else:
            batch.segment_list = [
                (indices[i], starts[i], starts[i + 1]) for i in range(len(segments))
            ]
        return batch

    def slot_ids(self) -> torch.Tensor:
        """Each of the forward's rows' stack index (-1: no adapter), int32 on the device: the
        CUDA kernels' per-row gather index. Made on first use, once per step."""
        if self._slot_ids is None:
            ids = [-1] * self.num_rows
            for i, index in enumerate(self.indices):
                for token in self.token_list[self.starts[i] : self.starts[i + 1]]:
                    ids[token] = index
            self._slot_ids = torch.tensor(ids, dtype=torch.int32).to(
                self.slots.device, non_blocking=True
            )
        return self._slot_ids

    def add(
        self,
        layer: int,
        group: str,
        x: torch.Tensor,
        out: torch.Tensor,
        kernel: LoraKernel | None = None,
    ) -> None:
        """out[t] += B_s (A_s x[t]) for every adapted token t (s its slot), in place, for each
        part of projection `group` of this rank's layer `layer` (its column slice of out).
        kernel: kernels.cuda.lora_add (engine.ops.KernelOps), run on padded (decode-like)
        steps; None: the torch products."""
        if group not in self.groups:
            return
        a = self.slots.a[group][layer]
        b = [part[layer] for part in self.slots.b[group]]
        if kernel is not None and self.padded:
            kernel(x, out, self.slot_ids(), a, b, self.rank)
            return
        if x.device.type == "cpu" and x.dtype == torch.float32 and cpu_lora_ready():
            # batch-invariant: each row's update alone, in a fixed order (kernels/cpu_lora.cpp)
            columns = list(itertools.accumulate((bp.shape[2] for bp in b[:-1]), initial=0))
            lora_rows(x, out, self.slot_ids(), a, b, columns, self.rank)
            return
        if self.padded:
            update = lora_padded(x, a, b, self.select, self.gather, self.positions, self.rank)
        else:
            update = lora_segments(x[self.tokens], a, b, self.segment_list, self.rank)
        if self.every_row:
            out.add_(update)
        else:
            out.index_add_(0, self.tokens, update)


@functools.cache
def cpu_lora_ready() -> bool:
    """Whether the batch-invariant CPU kernel runs here (built at the first adapted step); where
    it does not (no AVX2, no compiler), the torch products run, whose rows may round
    differently with the step's other rows (docs/lora.md)."""
    return cpu_lora_unavailable() is None


def _select(indices: list[int], max_loras: int, device: torch.device) -> Select:
    """The padded layout's slots (sorted stack indices): None for every slot, a slice for a run
    of consecutive ones (the tables read in place), else an index tensor (a gathered copy)."""
    if indices == list(range(max_loras)):
        return None
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return slice(indices[0], indices[0] + len(indices))
    return _tensor(indices, device)


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def kernel_self_check(kernel: LoraKernel, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `kernel` (kernels.cuda.lora_add) disagrees with kernels/lora_reference.py or fails on
    this device (None: it agrees), on a seeded step of 7 rows over three slots of ranks 4, 8
    and 16 and base rows, a three-part projection: run once when an engine with adapters
    starts on the CUDA kernels, before any request does."""
    gen = torch.Generator().manual_seed(28)
    ranks, widths, in_features = [4, 8, 16], [64, 16, 16], 64
    a = torch.randn(3, 16, 3, in_features, generator=gen) * in_features**-0.5
    b = [torch.randn(3, 16, w, generator=gen) for w in widths]
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        for bp in b:
            bp[slot, rank:] = 0
    x = torch.randn(7, in_features, generator=gen)
    base = torch.randn(7, sum(widths), generator=gen) * 0.1
    ids = torch.tensor([2, -1, 0, 1, 1, -1, 2], dtype=torch.int32)
    args = [t.to(device=device, dtype=dtype) for t in (x, base, a)]
    tables = [bp.to(device=device, dtype=dtype) for bp in b]
    try:
        got = kernel(args[0], args[1].clone(), ids.to(device), args[2], tables, 16)
    except Exception as err:  # a kernel that fails to compile or launch on this card
        return f"lora self-check: {type(err).__name__}: {err}"
    want = lora_add_reference(args[0], args[1].clone(), ids.to(device), args[2], tables, 16)
    error = (got.float() - want.float()).abs().max().item()
    if not error <= 2e-2 * max(1.0, want.float().abs().max().item()):
        return f"lora self-check: kernels.cuda.lora_add differs from the reference by {error:.3g}"
    return None
