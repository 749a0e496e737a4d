"""The scheduler side of both contracts: protobuf <-> scheduler dataclasses. Nothing else in
scheduler/ touches generated messages."""

from __future__ import annotations

from collections.abc import Sequence

from protos import common_pb2, engine_pb2, scheduler_pb2
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import StepOutcome, StepPlan, TopLogprobColumns

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
}


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


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        top_logprobs=params.top_logprobs,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def request_from_proto(msg: scheduler_pb2.SubmitRequest, seq_id: int) -> Request:
    return Request(
        request_id=msg.request_id or f"seq-{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=sampling_from_proto(msg.sampling),
        max_tokens=msg.max_tokens,
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
    )


def plan_to_proto(plan: StepPlan) -> engine_pb2.StepPlan:
    msg = engine_pb2.StepPlan(step_id=plan.step_id, finished_seq_ids=plan.finished_seq_ids)
    for row in plan.new_requests:
        r = row.request
        msg.new_requests.append(
            engine_pb2.NewRequest(
                seq_id=r.seq_id,
                token_ids=row.token_ids,
                num_prompt_tokens=r.num_prompt_tokens,
                sampling=sampling_to_proto(r.sampling),
                block_table=row.block_table,
                num_computed_tokens=row.num_computed_tokens,
                num_scheduled_tokens=row.num_scheduled_tokens,
            )
        )
    run = msg.running
    for running in plan.running:
        run.seq_ids.append(running.request.seq_id)
        run.num_scheduled_tokens.append(running.num_scheduled_tokens)
        run.num_computed_tokens.append(running.num_computed_tokens)
        run.num_new_blocks.append(len(running.new_block_ids))
        run.new_block_ids.extend(running.new_block_ids)
    return msg


def top_logprobs_from_proto(msg: engine_pb2.StepResult) -> TopLogprobColumns | None:
    if not msg.num_top_logprobs:
        return None
    return TopLogprobColumns(msg.num_top_logprobs, list(msg.top_token_ids), list(msg.top_logprobs))


def response_to_proto(
    token_ids: list[int],
    logprobs: list[float],
    finished: RequestStatus | None,
    request: Request,
    first: bool,
    top_logprobs: Sequence[StepOutcome] = (),
) -> scheduler_pb2.SubmitResponse:
    """top_logprobs: one outcome per token id, when the request asked for top logprobs."""
    msg = scheduler_pb2.SubmitResponse(
        token_ids=token_ids, logprobs=logprobs, finish_reason=FINISH_REASONS[finished]
    )
    for o in top_logprobs:
        msg.top_logprobs.add(token_ids=o.top_token_ids, logprobs=o.top_logprobs)
    if first or finished is not None:
        msg.num_prompt_tokens = request.num_prompt_tokens
        msg.num_cached_tokens = max(request.num_cached_tokens, 0)
    return msg
