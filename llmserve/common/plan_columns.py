"""The running rows' columns of a step plan (engine.proto's RunningColumns), as both sides'
converters read them: from the message's descriptor, so that a per-row field added to the .proto
needs no code in scheduler/service/convert.py, engine/convert.py or engine/contract.py. A new column is
filled from the scheduler's RunningRow attribute of its name (scheduler/plan.py) and read by the
engine as RunningData's attribute of its name (engine/contract.py).

    seq_ids          the rows' ids (the scheduler's row holds its request: row.request.seq_id)
    new_block_ids    ragged: row i's blocks are new_block_ids[sum(num_new_blocks[:i]) :
                     sum(num_new_blocks[:i + 1])] (the scheduler's row holds them as a list)
    any other        one value per row (VALUE_COLUMNS)

The core columns (CORE_COLUMNS) always hold one value per row. Any other is sent only when some
row's value is not 0: an empty one reads as 0 per row (the engine's RunningData.column).
"""

from __future__ import annotations

from llmserve.protos import engine_pb2

# Every column, in the .proto's order (RunningData's positional order too).
COLUMNS: tuple[str, ...] = tuple(f.name for f in engine_pb2.RunningColumns.DESCRIPTOR.fields)
ID_COLUMN = "seq_ids"
BLOCKS_COLUMN = "new_block_ids"
BLOCK_COUNT_COLUMN = "num_new_blocks"
CORE_COLUMNS = frozenset(
    {ID_COLUMN, "num_scheduled_tokens", "num_computed_tokens", BLOCK_COUNT_COLUMN, BLOCKS_COLUMN}
)
# The columns sent only when some row's value is not 0 (an empty one reads as 0 per row).
OPTIONAL_COLUMNS: tuple[str, ...] = tuple(name for name in COLUMNS if name not in CORE_COLUMNS)
# The columns of one value per row, named as the scheduler row's attribute that fills them.
VALUE_COLUMNS: tuple[str, ...] = tuple(
    name for name in COLUMNS if name not in (ID_COLUMN, BLOCKS_COLUMN, BLOCK_COUNT_COLUMN)
)
