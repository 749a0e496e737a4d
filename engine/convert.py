"""The engine side of the step contract: protobuf <-> engine/contract.py's dataclasses. Nothing else
in engine/ touches the generated stubs' messages."""

from __future__ import annotations

from dataclasses import asdict

from engine.contract import EngineInfo, NewRequestData, RunningData, StepOutput, StepPlanData
from protos import common_pb2, engine_pb2


def _new_request(msg: engine_pb2.NewRequest) -> NewRequestData:
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(msg.sampling)  # not a view: it would keep the whole plan alive
    return NewRequestData(
        seq_id=msg.seq_id,
        token_ids=list(msg.token_ids),
        num_prompt_tokens=msg.num_prompt_tokens,
        sampling=sampling,
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
    )
    new = [_new_request(r) for r in msg.new_requests]
    return StepPlanData(msg.step_id, list(msg.finished_seq_ids), new, running)


def result_to_proto(step_id: int, output: StepOutput, total_ms: float) -> engine_pb2.StepResult:
    return engine_pb2.StepResult(
        step_id=step_id,
        sampled_token_ids=output.sampled_token_ids,
        logprobs=output.logprobs or [],
        forward_ms=output.forward_ms,
        sample_ms=output.sample_ms,
        total_ms=total_ms,
        num_top_logprobs=output.num_top_logprobs,
        top_token_ids=output.top_token_ids,
        top_logprobs=output.top_logprobs,
        refused_seq_ids=output.refused_seq_ids,
        refusal_reasons=output.refusal_reasons,
    )


def info_to_proto(info: EngineInfo) -> engine_pb2.EngineInfo:
    return engine_pb2.EngineInfo(**asdict(info))
