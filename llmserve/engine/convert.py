"""The engine side of the step contract: protobuf <-> engine/contract.py's dataclasses. Nothing else
in engine/ touches the generated stubs' messages."""

from __future__ import annotations

from dataclasses import asdict
from operator import attrgetter

from llmserve.engine.contract import (
    BlockCopiesData,
    EngineInfo,
    GrammarCompileData,
    KVReceiveData,
    KVSendData,
    LoraLoadData,
    NewRequestData,
    RunningData,
    StepOutput,
    StepPlanData,
)
from llmserve.protos import engine_pb2

# NewRequest's fields, in order (all at once), and whether each is repeated (a list here).
_new_request_values = attrgetter(*NewRequestData.FIELDS)
_NEW_REQUEST_REPEATED = [f.is_repeated for f in engine_pb2.NewRequest.DESCRIPTOR.fields]
_running_columns = attrgetter(*RunningData.FIELDS)


def _new_request(msg: engine_pb2.NewRequest) -> NewRequestData:
    """msg's fields under the same names, repeated ones as lists (sampling stays a view for the
    step; the mirror keeps a normalized copy)."""
    values = _new_request_values(msg)
    return NewRequestData(
        *[list(v) if rep else v for v, rep in zip(values, _NEW_REQUEST_REPEATED, strict=True)]
    )


def plan_from_proto(msg: engine_pb2.StepPlan) -> StepPlanData:
    """msg as plan data, field for field (engine/contract.py; a field added to the .proto needs
    no code here)."""
    running = RunningData(*map(list, _running_columns(msg.running)))
    new = [_new_request(r) for r in msg.new_requests]
    loads = [LoraLoadData(m.slot, m.lora_name, m.path) for m in msg.lora_loads]
    copies = [
        BlockCopiesData(c.src_tier, c.dst_tier, list(c.src_ids), list(c.dst_ids))
        for c in msg.kv_copies
    ]
    compiles = [GrammarCompileData(g.seq_id, g.structured_output) for g in msg.grammar_compiles]
    return StepPlanData(
        msg.step_id, list(msg.finished_seq_ids), new, running, lora_loads=loads, kv_copies=copies,
        grammar_compiles=compiles,
        kv_sends=[KVSendData(m.transfer_id, list(m.block_ids), m.address) for m in msg.kv_sends],
        kv_receives=[KVReceiveData(m.transfer_id, list(m.block_ids)) for m in msg.kv_receives],
        kv_receive_cancels=list(msg.kv_receive_cancels),
    )  # fmt: skip


def result_to_proto(step_id: int, output: StepOutput, total_ms: float) -> engine_pb2.StepResult:
    """output's fields under the same names (logprobs None: none sent), plus the step's id and
    total time."""
    fields = {**vars(output), "logprobs": output.logprobs or []}
    return engine_pb2.StepResult(step_id=step_id, total_ms=total_ms, **fields)


def info_to_proto(info: EngineInfo) -> engine_pb2.EngineInfo:
    """info's fields under the same names (the parallel sizes included)."""
    return engine_pb2.EngineInfo(**asdict(info))
