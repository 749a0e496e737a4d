"""The step plan's converters follow engine.proto's descriptor (common/plan_columns.py): every
field has a source on the scheduler's side and a place on the engine's, and a plan crosses the
wire column for column."""

from __future__ import annotations

import dataclasses

from llmserve.common.plan_columns import COLUMNS, CORE_COLUMNS, VALUE_COLUMNS
from llmserve.common.step_plan import MESSAGES, RunningColumns
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.protos import engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import NewRequestRow, RunningRow
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import sampling


def test_every_field_has_a_source_row_attribute_and_an_engine_field() -> None:
    running_fields = {f.name for f in dataclasses.fields(RunningRow)}
    assert set(VALUE_COLUMNS) <= running_fields
    request = Request("r", 1, [1, 2], sampling(), 3)
    new_fields = {f.name for f in dataclasses.fields(NewRequestRow)}
    for name in engine_pb2.NewRequest.DESCRIPTOR.fields_by_name:
        assert name in new_fields or hasattr(request, name), name
    names = [f.name for f in dataclasses.fields(RunningColumns)]
    assert tuple(names) == COLUMNS == tuple(engine_pb2.RunningColumns.DESCRIPTOR.fields_by_name)


def test_the_typed_plan_is_the_proto_field_for_field() -> None:
    """common/step_plan.py's types carry their messages' fields, in order, under the same names
    (a field added to the .proto and not here fails), and the repeated ones as lists."""
    for cls, (message, left) in MESSAGES.items():
        descriptor = message.DESCRIPTOR
        expected = [f.name for f in descriptor.fields if f.name not in left]
        assert [f.name for f in dataclasses.fields(cls)] == expected, cls.__name__
        for f in dataclasses.fields(cls):
            repeated = descriptor.fields_by_name[f.name].is_repeated
            assert repeated == str(f.type).startswith("list["), (cls.__name__, f.name)


def test_running_data_reads_an_empty_optional_column_as_zeros() -> None:
    run = RunningColumns([4, 5], [1, 1], [7, 9], [0, 1], [3])
    assert [getattr(run, name) for name in COLUMNS[:5]] == [[4, 5], [1, 1], [7, 9], [0, 1], [3]]
    for name in COLUMNS[5:]:
        assert name not in CORE_COLUMNS and getattr(run, name) == []
        assert run.column(name) == [0, 0]
    run.seq_ids.append(6)  # rows may be added column by column
    assert run.column("num_lookahead_tokens") == [0, 0, 0]
    assert (
        RunningColumns(seq_ids=[1], num_lookahead_tokens=[2]).column("num_scheduled_tokens") == []
    )


def test_a_plan_crosses_column_for_column() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(config, 32, 4, 256, 100, (99,), num_speculative_tokens=3)
    for i in range(3):
        s.add(Request(f"r{i}", i + 1, [5 + i] * (3 + i), sampling(), 20))
    first = s.schedule()
    s.update(first, [7] * len(first.rows))
    s.add(Request("late", 9, [6] * 5, sampling(), 20))
    plan = s.schedule()
    assert plan.new_requests and plan.running
    assert any(row.num_lookahead_tokens for row in plan.running)
    data = plan_from_proto(engine_pb2.StepPlan.FromString(plan_to_proto(plan).SerializeToString()))
    (new,) = data.new_requests
    row = plan.new_requests[0]
    assert (new.seq_id, new.token_ids, new.block_table) == (9, row.token_ids, row.block_table)
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (4, 1)  # a prefix cache hit
    assert new.num_prompt_tokens == 5 and new.sampling == row.request.sampling
    run = data.running
    assert run.seq_ids == [r.request.seq_id for r in plan.running]
    for name in VALUE_COLUMNS:
        assert run.column(name) == [getattr(r, name) for r in plan.running], name
    assert run.num_new_blocks == [len(r.new_block_ids) for r in plan.running]
    assert run.new_block_ids == [b for r in plan.running for b in r.new_block_ids]


def test_an_all_zero_optional_column_is_not_sent() -> None:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(config, 32, 4, 256, 100, (99,))
    s.add(Request("r", 1, [5, 6, 7], sampling(), 20))
    s.update(s.schedule(), [7])
    msg = plan_to_proto(s.schedule())
    assert list(msg.running.seq_ids) == [1] and not msg.running.num_lookahead_tokens
