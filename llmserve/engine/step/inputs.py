"""The flattened inputs of one forward over segments of requests, and its attention metadata:
the one builder of the step's forward (engine/step/runner.py) and the draft's
(engine/features/proposer.py).

A segment is one request's tokens in this forward, `(block_table, input_ids, start)`: input_ids
at positions start, start + 1, ..., attending to the request's K/V before start (in the pool,
under block_table) and writing theirs:

    input_ids:     |<- segment 0 ->|<- segment 1 ->| ...
    cu_seqlens_q:  0               n0              n0 + n1
    seq_lens[i]:   start_i + n_i (the context segment i's last token sees)
"""

from __future__ import annotations

import torch

from llmserve.engine.model.ops import AttentionContext

Segment = tuple[list[int], list[int], int]


def _to_device(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


def padded_block_tables(
    tables: list[list[int]], num_blocks: int, device: torch.device
) -> torch.Tensor:
    """[len(tables), num_blocks] on device: each table's first num_blocks ids, padded with 0."""
    rows = [table[:num_blocks] for table in tables]
    return _to_device([row + [0] * (num_blocks - len(row)) for row in rows], device)


def flattened_inputs(
    segments: list[Segment],
    block_size: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    block_tables: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
    """(input_ids, positions, attention context) of one forward over segments, on device.
    block_tables: the segments' padded tables when the caller has them on the device already
    (wide enough for every segment); by default built here, as wide as the longest needs."""
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens_q = [0]
    seq_lens: list[int] = []
    for table, ids, start in segments:
        end = start + len(ids)
        input_ids.extend(ids)
        positions.extend(range(start, end))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        cu_seqlens_q.append(cu_seqlens_q[-1] + len(ids))
        seq_lens.append(end)
    if block_tables is None:
        max_blocks = max(-(-n // bs) for n in seq_lens)
        block_tables = padded_block_tables([t for t, _, _ in segments], max_blocks, device)
    ctx = AttentionContext(
        slot_mapping=_to_device(slots, device),
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        kv_caches=kv_caches,
    )
    return _to_device(input_ids, device), _to_device(positions, device), ctx
