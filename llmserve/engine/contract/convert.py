"""The engine side of the step contract: protobuf <-> the plan and result of
common/step_plan.py, and EngineInfo. Nothing else in engine/ touches the generated stubs'
messages."""

from __future__ import annotations

from dataclasses import asdict

from llmserve.common.step_plan import StepOutput, StepPlanData, from_proto, to_proto
from llmserve.engine.contract.contract import EngineInfo
from llmserve.protos import engine_pb2


def plan_from_proto(msg: engine_pb2.StepPlan) -> StepPlanData:
    """msg as plan data, field for field (sampling parameters stay views for the step; the
    mirror keeps a normalized copy)."""
    return from_proto(StepPlanData, msg)


def result_to_proto(step_id: int, output: StepOutput, total_ms: float) -> engine_pb2.StepResult:
    """output's fields under the same names (logprobs None: none sent), plus the step's id and
    total time."""
    msg: engine_pb2.StepResult = to_proto(output)
    msg.step_id, msg.total_ms = step_id, total_ms
    return msg


def info_to_proto(info: EngineInfo) -> engine_pb2.EngineInfo:
    """info's fields under the same names (the parallel sizes included)."""
    return engine_pb2.EngineInfo(**asdict(info))
