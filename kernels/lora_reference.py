"""Batched LoRA in plain torch: the ground truth for kernels/lora.cu and what the CPU engine runs
(engine/lora.py lays a step's rows out and calls lora_padded or lora_segments).

For one projection of one layer, with the adapters' tables as engine/lora.py holds them:

    a     [slots, parts, max_rank, in]: each slot's A of each part (q, k, v of qkv_proj ...)
    b[p]  [slots, max_rank, out_p]: each slot's B^T of part p, the scaling folded in
    (zero past a slot's rank, so the first `rank` rows of the step's highest rank are enough)

    out[t, part p's columns] += (x[t] @ a[s, p, :rank]^T) @ b[p][s, :rank]    s = the row's slot

in x's dtype: the shrink rounds to it, then the expand, then the add (as the CUDA kernels do).
Rows without an adapter are left as they are. Never a loop over rows, never a merged weight.
"""

from __future__ import annotations

import torch


def lora_add(
    x: torch.Tensor,
    out: torch.Tensor,
    slot_ids: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    rank: int,
) -> torch.Tensor:
    """out (updated in place and returned) += each row's update, the CUDA kernels' contract:
    x [rows, in]; out [rows, sum of out_p]; slot_ids [rows] int (outside 0 .. slots - 1: no
    adapter). The rows grouped by slot (a stable sort), one lora_segments product per group."""
    num_slots = a.shape[0]
    ids = slot_ids.to(torch.int64)
    adapted = ((ids >= 0) & (ids < num_slots)).nonzero().flatten()
    if not adapted.numel():
        return out
    order = torch.argsort(ids[adapted], stable=True)
    tokens = adapted[order]
    counts = torch.bincount(ids[tokens], minlength=num_slots).tolist()
    segments, start = [], 0
    for slot, count in enumerate(counts):
        if count:
            segments.append((slot, start, start + count))
            start += count
    update = lora_segments(x[tokens], a, b, segments, rank)
    return out.index_add_(0, tokens, update.to(out.dtype))


def lora_padded(
    x: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    indices: torch.Tensor | None,
    gather: torch.Tensor,
    positions: torch.Tensor,
    rank: int,
) -> torch.Tensor:
    """The update of the adapted tokens [n, sum of parts' out], padded layout (engine/lora.py's
    LoraBatch: segment i's token j at row i * longest + j of one batch; `gather` names each
    row's token, `positions` each token's row): x [tokens, in]; the first `rank` ranks of the
    stack indices' slots (None: every slot, in order). One batched matmul each way."""
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
    expand matmul per segment (slot, start, end) and part."""
    outputs = []
    for index, start, end in segments:
        shrunk = xs[start:end] @ a[index, :, :rank].flatten(0, 1).t()
        parts = [shrunk[:, p * rank : (p + 1) * rank] @ bp[index, :rank] for p, bp in enumerate(b)]
        outputs.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
