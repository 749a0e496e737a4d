"""Batched LoRA: the device-resident slot table of adapters and the per-step segmented low-rank
products over the rows that use them.

Slots are numbered 1 .. max_loras as the plan names them (0: the base model, no adapter). For
each of our projections (GROUPS: qkv_proj adapts q, k and v, gate_up_proj gate and up) the
table holds, per layer of this rank, every slot's A stacked by part and B per part:

    a[group]     [num_layers, max_loras, num_parts, max_rank, in_features]
    b[group][p]  [num_layers, max_loras, max_rank, out_features of part p]

zero where a slot's adapter has a lower rank or does not adapt that module, so a zero slice adds
nothing. Tensor-parallel, A and B are split as their base layer is: column-parallel modules (q,
k, v, gate, up) keep this rank's rows of B, row-parallel ones (o, down) its columns of A (their
partial products are summed by the layer's all-reduce, with the base output's).

A step's rows are grouped by slot (LoraBatch): each group's tokens are a segment, and a
projection's update is, per segment, shrink (x A^T: [tokens, r]) then expand (B: [tokens, out])
added to the base output. Two layouts of the same product (kernels/reference.py's
lora_shrink_expand and its segment loop): padded (segments as one [segments, longest, in]
batch, one batched matmul each way: decode steps, whose segments are short) or one matmul pair
per segment (steps with a long prefill segment, which padding would multiply). Never a loop
over rows, never the adapter merged into the base weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.model_config import ModelConfig
from engine.lora_files import LoraAdapter, module_shapes
from engine.parallel import ModelShard

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
    """max_loras adapters resident on the device, one per slot, for this rank's layers."""

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
        shape = (layers, self.max_loras, len(parts), self.max_rank, in_features)
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
            self.a[group][layer - start, index, part, :rank].copy_(a)
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
        return LoraBatch.build(self, [by_slot[s] for s in slots], [s - 1 for s in slots], rank)


@dataclass
class LoraBatch:
    """One step's rows grouped by slot. `tokens`: the adapted tokens' indices in the forward,
    segment after segment; segment i is tokens[starts[i]:starts[i+1]], of stack index
    indices[i]. Padded layout (padded=True): segment i's token j sits at row i * longest + j of
    a [segments * longest] batch; `gather` names each row's token (0 for padding) and
    `positions` each token's row."""

    slots: LoraSlots
    groups: frozenset[str]
    rank: int
    tokens: torch.Tensor
    starts: list[int]
    indices: list[int]
    index_t: torch.Tensor
    longest: int
    padded: bool
    gather: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    segment_list: list[tuple[int, int, int]] = field(default_factory=list)

    @classmethod
    def build(
        cls, slots: LoraSlots, segments: list[list[int]], indices: list[int], rank: int
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
            _tensor(flat, device), starts, indices, _tensor(indices, device), longest, padded,
        )  # fmt: skip
        if padded:
            gather = [0] * (len(segments) * longest)
            positions = []
            for i, tokens in enumerate(segments):
                rows = range(i * longest, i * longest + len(tokens))
                positions.extend(rows)
                for row, token in zip(rows, tokens, strict=True):
                    gather[row] = token
            batch.gather, batch.positions = _tensor(gather, device), _tensor(positions, device)
        else:
            batch.segment_list = [
                (indices[i], starts[i], starts[i + 1]) for i in range(len(segments))
            ]
        return batch

    def add(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out[t] += B_s (A_s x[t]) for every adapted token t (s its slot), in place, for each
        part of projection `group` of this rank's layer `layer` (its column slice of out)."""
        if group not in self.groups:
            return
        a = self.slots.a[group][layer]
        b = [part[layer] for part in self.slots.b[group]]
        if self.padded:
            assert self.gather is not None and self.positions is not None
            # Every slot in order: the tables as they are, without gathering a copy.
            every = len(self.indices) == self.slots.max_loras
            indices = None if every else self.index_t
            update = lora_padded(x, a, b, indices, self.gather, self.positions, self.rank)
        else:
            update = lora_segments(x[self.tokens], a, b, self.segment_list, self.rank)
        out.index_add_(0, self.tokens, update)


def lora_padded(
    x: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    indices: torch.Tensor | None,
    gather: torch.Tensor,
    positions: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """The update of the adapted tokens [n, sum of parts' out], padded layout (LoraBatch):
    x [tokens, in]; a [slots, parts, max_rank, in]; b[p] [slots, max_rank, out_p]; the first
    `rank` ranks of the stack indices' slots (None: every slot, in order)."""
    num_segments = a.shape[0] if indices is None else indices.shape[0]
    xs = x[gather].view(num_segments, -1, x.shape[1])
    shrink_w = (a[:, :, :rank] if indices is None else a[indices, :, :rank]).flatten(1, 2)
    shrunk = torch.bmm(xs, shrink_w.transpose(1, 2))  # [segments, longest, parts * rank]
    parts = [
        torch.bmm(
            shrunk[:, :, p * rank : (p + 1) * rank],
            bp[:, :rank] if indices is None else bp[indices, :rank],
        )
        for p, bp in enumerate(b)
    ]
    expanded = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return expanded.flatten(0, 1)[positions]


def lora_segments(
    xs: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    segments: list[tuple[int, int, int]],
    rank: int,
) -> torch.Tensor:
    """The same update from xs, the adapted tokens' rows grouped by slot, one shrink and one
    expand matmul per segment (stack index, start, end) and part."""
    outputs = []
    for index, start, end in segments:
        shrunk = xs[start:end] @ a[index, :, :rank].flatten(0, 1).t()
        parts = [shrunk[:, p * rank : (p + 1) * rank] @ bp[index, :rank] for p, bp in enumerate(b)]
        outputs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
