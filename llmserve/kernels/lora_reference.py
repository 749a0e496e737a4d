"""Batched LoRA in plain torch: the ground truth for kernels/lora.cu and what the CPU engine runs
(engine/features/lora.py lays a step's rows out and calls lora_padded or lora_segments).

For one projection of one layer, the adapters' tables as engine/features/lora.py holds them:

    a     [slots, max_rank, parts, in]: each slot's row j of each part's A (q, k, v of qkv_proj
          ...), rank before part, so that the first r ranks of every part, a[s, :r], are one
          contiguous [r * parts, in] matrix: the shrink of every part in one product (its
          output column j * parts + p is part p's rank j)
    b[p]  [slots, max_rank, out_p]: each slot's B^T of part p, the scaling folded in
    (zero past a slot's rank, so the first `rank` rows of the step's highest rank are enough)

    out[t, part p's columns] += (x[t] @ a[s, :rank, p]^T) @ b[p][s, :rank]    s = the row's slot

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


Select = slice | torch.Tensor | None  # which slots a padded step's segments use, in order


def lora_padded(
    x: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    select: Select,
    gather: torch.Tensor | None,
    positions: torch.Tensor | None,
    rank: int,
) -> torch.Tensor:
    """The update of the adapted tokens [n, sum of parts' out], padded layout
    (engine/features/lora.py's LoraBatch: segment i's token j at row i * longest + j of one batch;
    `gather` names each row's token, `positions` each token's row; None: the identity, nothing
    copied): x [tokens, in]; the first `rank` ranks of the slots `select` names (None: every slot; a
    slice: a run of them, read in place; else an index tensor). One batched matmul for the shrink of
    every part, one per part for the expand. With one token per segment (decode), A times x as
    batched matrix-vector products and the parts joined by a cat; with more, x times A^T and each
    part written into its columns: the faster form of each on the CPU
    (one thread, the built-in model's shapes; `llmserve bench step` times whole steps)."""
    a_sel = (a if select is None else a[select])[:, :rank].flatten(1, 2)  # [segs, r * parts, in]
    num_segments, num_parts = a_sel.shape[0], len(b)
    xs = (x if gather is None else x[gather]).view(num_segments, -1, x.shape[1])
    b_sel = [bp[:, :rank] if select is None else bp[select, :rank] for bp in b]
    if xs.shape[1] == 1:  # batched matrix-vector products, then the parts side by side
        shrunk = torch.bmm(a_sel, xs.transpose(1, 2)).transpose(1, 2)  # [segs, 1, r * parts]
        parts = [torch.bmm(shrunk[:, :, p::num_parts], bp) for p, bp in enumerate(b_sel)]
        update = parts[0] if num_parts == 1 else torch.cat(parts, dim=2)
    else:  # matrix products, each part's written into its columns
        shrunk = torch.bmm(xs, a_sel.transpose(1, 2))  # [segs, longest, r * parts]
        widths = [bp.shape[2] for bp in b]
        update = torch.empty(*shrunk.shape[:2], sum(widths), dtype=x.dtype, device=x.device)
        column = 0
        for p, (bp, width) in enumerate(zip(b_sel, widths, strict=True)):
            part = shrunk if num_parts == 1 else shrunk[:, :, p::num_parts]
            update[:, :, column : column + width].baddbmm_(part, bp, beta=0)
            column += width
    flat = update.flatten(0, 1)
    return flat if positions is None else flat[positions]


def lora_segments(
    xs: torch.Tensor,
    a: torch.Tensor,
    b: list[torch.Tensor],
    segments: list[tuple[int, int, int]],
    rank: int,
) -> torch.Tensor:
    """The same update from xs, the adapted tokens' rows grouped by slot, one shrink matmul
    per segment (slot, start, end) and one expand per segment and part, written in place."""
    num_parts, widths = len(b), [bp.shape[2] for bp in b]
    update = torch.empty(xs.shape[0], sum(widths), dtype=xs.dtype, device=xs.device)
    for index, start, end in segments:
        shrunk = xs[start:end] @ a[index, :rank].flatten(0, 1).t()
        column = 0
        for p, (bp, width) in enumerate(zip(b, widths, strict=True)):
            part = shrunk if num_parts == 1 else shrunk[:, p::num_parts]
            update[start:end, column : column + width].addmm_(part, bp[index, :rank], beta=0)
            column += width
    return update
