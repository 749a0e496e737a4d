"""The scheduler side of both contracts: protobuf <-> scheduler dataclasses. Nothing else in
scheduler/ touches generated messages. Sampling params are never decoded: the scheduler passes
them from Submit to the engine as they came (checked and normalized by common.sampling)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from llmserve.common.plan_columns import CORE_COLUMNS, VALUE_COLUMNS
from llmserve.common.sampling import MAX_TOP_LOGPROBS, SamplingError, normalized
from llmserve.common.step_plan import (
    GrammarCompile,
    NewRequest,
    RunningColumns,
    StepPlanData,
    output_from_proto,
    to_proto,
)
from llmserve.protos import common_pb2, engine_pb2, scheduler_pb2
from llmserve.scheduler.admin import RequestRow, TenantRow
from llmserve.scheduler.plan import (
    NewRequestRow,
    PromptScoreColumns,
    RunningRow,
    StepOutcome,
    StepPlan,
    TopLogprobColumns,
    take_prompt_scores,
)
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler

FINISH_REASONS = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
    RequestStatus.FINISHED_GRAMMAR_DEAD_END: common_pb2.FINISH_REASON_GRAMMAR_DEAD_END,
}


def request_from_proto(msg: scheduler_pb2.SubmitRequest, seq_id: int) -> Request:
    """Raises common.sampling.SamplingError (a ValueError naming the field) on bad params."""
    if not 0 <= msg.prompt_top_logprobs <= MAX_TOP_LOGPROBS:
        raise SamplingError(
            f"prompt_top_logprobs={msg.prompt_top_logprobs} is outside [0, {MAX_TOP_LOGPROBS}]"
        )
    return Request(
        request_id=msg.request_id or f"seq-{seq_id}",
        seq_id=seq_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling=normalized(msg.sampling),
        max_tokens=msg.max_tokens,
        stop_token_ids=frozenset(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        disable_speculation=msg.disable_speculation,
        tenant=msg.tenant,
        tenant_weight=msg.tenant_weight if msg.tenant_weight > 0 else 1.0,
        priority=msg.priority,
        lora_name=msg.lora_name,
        prompt_logprobs=msg.prompt_logprobs,
        prompt_top_logprobs=msg.prompt_top_logprobs,
    )


def plan_data(plan: StepPlan) -> StepPlanData:
    """The engine's view of plan (common/step_plan.py): each row field from the row's attribute
    of its name, or else its request's; the running rows as columns."""
    compiles = [
        GrammarCompile(r.seq_id, r.sampling.structured_output) for r in plan.grammar_compiles
    ]
    return StepPlanData(
        plan.step_id, plan.finished_seq_ids, [new_request(row) for row in plan.new_requests],
        running_columns(plan.running), plan.lora_loads, plan.kv_copies, compiles,
        plan.kv_sends, plan.kv_receives, plan.kv_receive_cancels,
        [s.from_slot for s in plan.state_snapshots], [s.to_slot for s in plan.state_snapshots],
    )  # fmt: skip


def plan_to_proto(plan: StepPlan) -> engine_pb2.StepPlan:
    msg: engine_pb2.StepPlan = to_proto(plan_data(plan))
    return msg


# NewRequest's fields, each read from the row's attribute of its name (the plan's snapshot), or
# else from its request's.
_ROW_FIELDS = {f.name for f in dataclasses.fields(NewRequestRow)}
_NEW_REQUEST_FIELDS = [
    (f.name, attrgetter(f.name if f.name in _ROW_FIELDS else f"request.{f.name}"))
    for f in dataclasses.fields(NewRequest)
]


def new_request(row: NewRequestRow) -> NewRequest:
    """row's NewRequest: each field from the row's attribute of its name, or else from its
    request's (a field added to the .proto and to NewRequest needs no code here)."""
    return NewRequest(**{name: value(row) for name, value in _NEW_REQUEST_FIELDS})


# (column, whether always sent, the row's value) for each column of one value per row.
_VALUE_COLUMNS = [(name, name in CORE_COLUMNS, attrgetter(name)) for name in VALUE_COLUMNS]


def running_columns(rows: list[RunningRow]) -> RunningColumns:
    """rows as columns, by common/plan_columns.py's rules: each column of one value per row
    from the rows' attribute of its name (a column other than the core ones only when some
    row's value is not 0), the ids from the rows' requests, the new blocks ragged."""
    columns = RunningColumns()
    if not rows:
        return columns  # an empty plan part is left unset
    columns.seq_ids = [row.request.seq_id for row in rows]
    for name, always, value in _VALUE_COLUMNS:
        values = list(map(value, rows))
        if always or any(values):
            setattr(columns, name, values)
    blocks = [row.new_block_ids for row in rows]
    columns.num_new_blocks = list(map(len, blocks))
    columns.new_block_ids = [b for ids in blocks for b in ids]
    return columns


def apply_result(
    scheduler: Scheduler, plan: StepPlan, result: engine_pb2.StepResult
) -> list[StepOutcome]:
    """Scheduler.update with the engine's StepResult for plan (read as common/step_plan.py's
    StepOutput: empty optional columns as None), after releasing the held requests whose
    grammar it reports compiled and taking the prompt scores it returns, then the KV transfers
    it reports received."""
    out = output_from_proto(result)
    scheduler.grammars_compiled(out.compiled_seq_ids)
    scheduler.grammar_dead_ends(out.dead_end_seq_ids)
    if out.num_prompt_logprobs:
        take_prompt_scores(plan, PromptScoreColumns(
            out.num_prompt_logprobs, out.prompt_logprobs, out.prompt_logprob_ranks,
            out.prompt_top_token_ids, out.prompt_top_logprobs,
        ))  # fmt: skip
    top = None
    if out.num_top_logprobs:
        top = TopLogprobColumns(out.num_top_logprobs, out.top_token_ids, out.top_logprobs)
    outcomes = scheduler.update(
        plan, out.sampled_token_ids, out.logprobs, top,
        out.num_sampled_tokens or None, out.num_draft_tokens or None,
    )  # fmt: skip
    if out.received_transfer_ids:
        scheduler.handoffs.on_received(out.received_transfer_ids)
    if out.failed_transfer_ids:
        scheduler.handoffs.fail("dropped", transfer_ids=out.failed_transfer_ids)
    return outcomes


def response_to_proto(
    request: Request, outcomes: Sequence[StepOutcome], first: bool
) -> scheduler_pb2.SubmitResponse:
    """One message for a request's outcomes since its last one (the last may finish it)."""
    tokens = [o for o in outcomes if o.token_id is not None]
    msg = scheduler_pb2.SubmitResponse(
        token_ids=[o.token_id for o in outcomes if o.token_id is not None],
        logprobs=[o.logprob for o in tokens if o.logprob is not None],
        finish_reason=FINISH_REASONS[outcomes[-1].finished],
    )
    for o in tokens:
        if o.top_token_ids:
            msg.top_logprobs.add(token_ids=o.top_token_ids, logprobs=o.top_logprobs)
    if first and request.prompt_logprobs:  # all in by the first token (the last chunk's step)
        scores = request.prompt_scores
        msg.prompt_logprobs.extend(s.logprob for s in scores)
        msg.prompt_logprob_ranks.extend(s.rank for s in scores)
        if request.prompt_top_logprobs:
            for s in scores:
                msg.prompt_top_logprobs.add(token_ids=s.top_token_ids, logprobs=s.top_logprobs)
    if first or outcomes[-1].finished is not None:
        msg.num_prompt_tokens = request.num_prompt_tokens
        msg.num_cached_tokens = request.num_cached_tokens or 0
    return msg


def stats_to_proto(stats: dict[str, Any]) -> scheduler_pb2.SchedulerStats:
    """GetStats' message from a stats snapshot (the fields it has; `tenants`: TenantRows)."""
    names = scheduler_pb2.SchedulerStats.DESCRIPTOR.fields_by_name
    msg = scheduler_pb2.SchedulerStats()
    for name, value in stats.items():
        if name == "tenants":
            msg.tenants.extend(map(tenant_to_proto, value))
        elif name == "engines":
            msg.engines.extend(scheduler_pb2.EngineRow(**row) for row in value)
        elif name in names and isinstance(value, dict):
            getattr(msg, name).update(value)
        elif name in names and isinstance(value, list):
            getattr(msg, name).extend(value)
        elif name in names:
            setattr(msg, name, type(getattr(msg, name))(value))
    return msg


def tenant_to_proto(row: TenantRow) -> scheduler_pb2.TenantStats:
    return scheduler_pb2.TenantStats(**vars(row))


def request_state_to_proto(row: RequestRow) -> scheduler_pb2.RequestState:
    return scheduler_pb2.RequestState(**vars(row))
