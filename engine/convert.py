"""The engine side of the step contract: protobuf <-> the mirror's dataclasses. Nothing else in
engine/ touches the generated stubs' messages."""

from __future__ import annotations

from engine.mirror import (
    NewRequestData,
    RunningData,
    SamplingParams,
    StepPlanData,
)
from protos import common_pb2, engine_pb2


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p,
        min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        top_logprobs=msg.top_logprobs,
    )


def plan_from_proto(msg: engine_pb2.StepPlan) -> StepPlanData:
    new = [
        NewRequestData(
            seq_id=r.seq_id,
            token_ids=list(r.token_ids),
            num_prompt_tokens=r.num_prompt_tokens,
            sampling=sampling_from_proto(r.sampling),
            block_table=list(r.block_table),
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=r.num_scheduled_tokens,
        )
        for r in msg.new_requests
    ]
    run = msg.running
    running = RunningData(
        seq_ids=list(run.seq_ids),
        num_scheduled_tokens=list(run.num_scheduled_tokens),
        num_computed_tokens=list(run.num_computed_tokens),
        num_new_blocks=list(run.num_new_blocks),
        new_block_ids=list(run.new_block_ids),
    )
    return StepPlanData(msg.step_id, list(msg.finished_seq_ids), new, running)


def result_to_proto(
    step_id: int,
    sampled_token_ids: list[int],
    logprobs: list[float] | None,
    forward_ms: float,
    sample_ms: float,
    total_ms: float,
    num_top_logprobs: int = 0,
    top_token_ids: list[int] | None = None,
    top_logprobs: list[float] | None = None,
) -> engine_pb2.StepResult:
    return engine_pb2.StepResult(
        step_id=step_id,
        sampled_token_ids=sampled_token_ids,
        logprobs=logprobs or [],
        forward_ms=forward_ms,
        sample_ms=sample_ms,
        total_ms=total_ms,
        num_top_logprobs=num_top_logprobs,
        top_token_ids=top_token_ids or [],
        top_logprobs=top_logprobs or [],
    )


def info_to_proto(
    model: str,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: tuple[int, ...],
    block_size: int,
    num_blocks: int,
    device: str,
    dtype: str,
) -> engine_pb2.EngineInfo:
    return engine_pb2.EngineInfo(
        model=model,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=list(eos_token_ids),
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
        dtype=dtype,
    )
