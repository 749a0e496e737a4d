"""The engine side of the step contract: protobuf <-> engine/contract.py's dataclasses. Nothing else
in engine/ touches the generated stubs' messages."""

from __future__ import annotations

from dataclasses import asdict

from engine.contract import EngineInfo, NewRequestData, RunningData, StepOutput, StepPlanData
from protos import engine_pb2


def _new_request(msg: engine_pb2.NewRequest) -> NewRequestData:
    return NewRequestData(
        seq_id=msg.seq_id,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        sampling=msg.sampling,  # a view for the step; the mirror keeps a normalized copy
        block_table=list(msg.block_table),
        num_computed_tokens=msg.num_computed_tokens,
        num_scheduled_tokens=msg.num_scheduled_tokens,
    )


def plan_from_proto(msg: engine_pb2.StepPlan) -> StepPlanData:
    run = msg.running
    running = RunningData(
        seq_ids=list(run.seq_ids),
        num_scheduled_tokens=list(run.num_scheduled_tokens),
        num_computed_tokens=list(run.num_computed_tokens),
        num_new_blocks=list(run.num_new_blocks),
        new_block_ids=list(run.new_block_ids),
        num_lookahead_tokens=list(run.num_lookahead_tokens),
    )
    new = [_new_request(r) for r in msg.new_requests]
    return StepPlanData(msg.step_id, list(msg.finished_seq_ids), new, running)


def result_to_proto(step_id: int, output: StepOutput, total_ms: float) -> engine_pb2.StepResult:
    """output's fields under the same names (logprobs None: none sent), plus the step's id and
    total time."""
    fields = {**vars(output), "logprobs": output.logprobs or []}
    return engine_pb2.StepResult(step_id=step_id, total_ms=total_ms, **fields)


def info_to_proto(info: EngineInfo) -> engine_pb2.EngineInfo:
    """info's fields under the same names (the parallel sizes included)."""
    return engine_pb2.EngineInfo(**asdict(info))
