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

import numpy as np
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


class BlockTables:
    """The padded block tables of a step's rows, each row's ids kept in a numpy array between
    steps so that a step copies only the ids appended since the last one: at block size 1
    (token-level KV) a table has one id per token, and rebuilding [rows, blocks] from Python
    lists every step cost 21-81 ms at 64 rows x 2,048 tokens on a loaded 2-core VM, this
    0.7 ms (bench/studies/token_level_kv.py).

    Assumes what engine/contract/mirror.py does to a table: a new request brings a new list, a step
    appends to it (new blocks), and giving back speculation's lookahead blocks makes a new,
    shorter list; ids already in a list never change (a cheap check trips if the last one
    known did). A row is remembered while its list is in every step; one left out for a step
    is copied whole when it comes back."""

    def __init__(self) -> None:
        # id(list) -> (the list, its ids so far (capacity >= count), count)
        self.rows: dict[int, tuple[list[int], np.ndarray, int]] = {}

    def _synced(
        self, table: list[int], old: dict[int, tuple[list[int], np.ndarray, int]]
    ) -> tuple[list[int], np.ndarray, int]:
        """(table, its ids as an array, their count), copying only what is new since `old`."""
        entry = old.get(id(table))
        n = len(table)
        if entry is None or entry[0] is not table:
            ids = np.empty(max(16, 2 * n), np.int64)
            ids[:n] = table
        else:
            ids, known = entry[1], entry[2]
            assert n >= known and (known == 0 or ids[known - 1] == table[known - 1]), (
                "a block table changed in place (engine/contract/mirror.py only appends)"
            )
            if n > known:
                if n > ids.shape[0]:
                    ids = np.concatenate([ids[:known], np.empty(2 * n - known, np.int64)])
                ids[known:n] = table[known:n]
        return table, ids, n

    def padded(
        self, tables: list[list[int]], num_blocks: int, device: torch.device
    ) -> torch.Tensor:
        """[len(tables), num_blocks] on device, as padded_block_tables makes it."""
        old, self.rows = self.rows, {}
        out = np.zeros((len(tables), num_blocks), np.int64)
        for i, table in enumerate(tables):
            entry = self.rows[id(table)] = self._synced(table, old)
            k = min(entry[2], num_blocks)
            out[i, :k] = entry[1][:k]
        return torch.from_numpy(out).to(device, non_blocking=True)


def flattened_inputs(
    segments: list[Segment],
    block_size: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    block_tables: torch.Tensor | None = None,
    tables: BlockTables | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
    """(input_ids, positions, attention context) of one forward over segments, on device.
    block_tables: the segments' padded tables when the caller has them on the device already
    (wide enough for every segment); by default built here, as wide as the longest needs, from
    `tables` (kept between steps) when given."""
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
        rows = [t for t, _, _ in segments]
        block_tables = (
            padded_block_tables(rows, max_blocks, device)
            if tables is None
            else tables.padded(rows, max_blocks, device)
        )
    ctx = AttentionContext(
        slot_mapping=_to_device(slots, device),
        block_tables=block_tables,
        seq_lens=seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        kv_caches=kv_caches,
    )
    return _to_device(input_ids, device), _to_device(positions, device), ctx
