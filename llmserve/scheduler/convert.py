"""The scheduler side of both contracts: protobuf <-> scheduler dataclasses. Nothing else in
scheduler/ touches generated messages. Sampling params are never decoded: the scheduler passes
them from Submit to the engine as they came (checked and normalized by common.sampling)."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

from llmserve.common.plan_columns import CORE_COLUMNS, VALUE_COLUMNS
from llmserve.common.sampling import normalized
from llmserve.protos import common_pb2, engine_pb2, scheduler_pb2
from llmserve.scheduler.admin import RequestRow, TenantRow
from llmserve.scheduler.plan import (
    NewRequestRow,
    RunningRow,
    StepOutcome,
    StepPlan,
    TopLogprobColumns,
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
    )


# The KV tiers by name (scheduler/kv_offload.py) as engine.proto's KVTier.
KV_TIERS = {
    "device": engine_pb2.KV_TIER_DEVICE,
    "host": engine_pb2.KV_TIER_HOST,
    "disk": engine_pb2.KV_TIER_DISK,
}


def plan_to_proto(plan: StepPlan) -> engine_pb2.StepPlan:
    msg = engine_pb2.StepPlan(step_id=plan.step_id, finished_seq_ids=plan.finished_seq_ids)
    for row in plan.new_requests:
        msg.new_requests.add(**new_request_fields(row))
    running_to_proto(plan.running, msg.running)
    for load in plan.lora_loads:
        msg.lora_loads.add(slot=load.slot, lora_name=load.lora_name, path=load.path)
    for src, dst, src_ids, dst_ids in plan.kv_copies:
        msg.kv_copies.add(
            src_tier=KV_TIERS[src], dst_tier=KV_TIERS[dst], src_ids=src_ids, dst_ids=dst_ids
        )
    for request in plan.grammar_compiles:
        msg.grammar_compiles.add(
            seq_id=request.seq_id, structured_output=request.sampling.structured_output
        )
    for transfer_id, block_ids, address in plan.kv_sends:
        msg.kv_sends.add(transfer_id=transfer_id, block_ids=block_ids, address=address)
    for transfer_id, block_ids in plan.kv_receives:
        msg.kv_receives.add(transfer_id=transfer_id, block_ids=block_ids)
    msg.kv_receive_cancels.extend(plan.kv_receive_cancels)
    return msg


# NewRequest's fields, each read from the row's attribute of its name (the plan's snapshot), or
# else from its request's.
_NEW_REQUEST_FIELDS = [
    (name, attrgetter(name if name in NewRequestRow.__dataclass_fields__ else f"request.{name}"))
    for name in engine_pb2.NewRequest.DESCRIPTOR.fields_by_name
]


def new_request_fields(row: NewRequestRow) -> dict[str, Any]:
    """row's NewRequest fields: each from the row's attribute of its name, or else from its
    request's (a field added to the .proto needs no code here)."""
    return {name: value(row) for name, value in _NEW_REQUEST_FIELDS}


# (column, whether always sent, the row's value) for each column of one value per row.
_VALUE_COLUMNS = [(name, name in CORE_COLUMNS, attrgetter(name)) for name in VALUE_COLUMNS]


def running_to_proto(rows: list[RunningRow], msg: engine_pb2.RunningColumns) -> None:
    """Fill msg's columns from rows, by common/plan_columns.py's rules: each column of one value
    per row from the rows' attribute of its name (a column other than the core ones only when
    some row's value is not 0), the ids from the rows' requests, the new blocks ragged."""
    if not rows:
        return  # an empty plan part is left unset
    msg.seq_ids.extend([row.request.seq_id for row in rows])
    for name, always, value in _VALUE_COLUMNS:
        values = list(map(value, rows))
        if always or any(values):
            getattr(msg, name).extend(values)
    blocks = [row.new_block_ids for row in rows]
    msg.num_new_blocks.extend(list(map(len, blocks)))
    msg.new_block_ids.extend([b for ids in blocks for b in ids])


def top_logprobs_from_proto(msg: engine_pb2.StepResult) -> TopLogprobColumns | None:
    if not msg.num_top_logprobs:
        return None
    return TopLogprobColumns(
        list(msg.num_top_logprobs), list(msg.top_token_ids), list(msg.top_logprobs)
    )


def apply_result(
    scheduler: Scheduler, plan: StepPlan, result: engine_pb2.StepResult
) -> list[StepOutcome]:
    """Scheduler.update with the engine's StepResult for plan (its columns unpacked: empty
    optional ones as None), after releasing the held requests whose grammar it reports
    compiled, then the KV transfers it reports received."""
    scheduler.grammars_compiled(list(result.compiled_seq_ids))
    scheduler.grammar_dead_ends(list(result.dead_end_seq_ids))
    outcomes = scheduler.update(
        plan,
        list(result.sampled_token_ids),
        list(result.logprobs) or None,
        top_logprobs_from_proto(result),
        list(result.num_sampled_tokens) or None,
        list(result.num_draft_tokens) or None,
    )
    if result.received_transfer_ids:
        scheduler.handoffs.on_received(list(result.received_transfer_ids))
    if result.failed_transfer_ids:
        scheduler.handoffs.fail("dropped", transfer_ids=list(result.failed_transfer_ids))
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
