"""What the engine tells OpenTelemetry: a span per step (child of the scheduler's step span, whose
context comes in the StepPlan) with forward and sampling as child spans, and step metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from llmserve.common import telemetry
from llmserve.common.telemetry import Metric
from llmserve.protos import engine_pb2

_BUCKETS = telemetry.TOKEN_LATENCY_BUCKETS_S
METRICS = {
    "forward": Metric(
        "llmserve.engine.forward.duration", "histogram", "s", "Model forward pass of one step",
        _BUCKETS,
    ),
    "sample": Metric(
        "llmserve.engine.sample.duration", "histogram", "s", "Sampling of one step", _BUCKETS
    ),
    "step": Metric(
        "llmserve.engine.step.duration", "histogram", "s",
        "One step in the engine: plan in to result out", _BUCKETS,
    ),
    "tokens": Metric("llmserve.engine.tokens", "counter", "{token}", "Tokens computed"),
    # --quantization auto on GGUF blocks (engine/model/cpu_weights.py): the path and its reason
    "cpu_dense_rows": Metric(
        "llmserve.engine.model.cpu_weights.dense_rows", "gauge", "{row}",
        "From how many rows a step multiplies the dense weight copy (0: the GGUF blocks only); "
        "attributes: path, dtype, reason",
    ),
    "cpu_weight_steps": Metric(
        "llmserve.engine.model.cpu_weights.steps", "observed_counter", "{step}",
        "Steps by the weights their layers multiplied (path: packed = GGUF blocks, dense)",
    ),
}  # fmt: skip


class EngineTelemetry:
    def __init__(self, weight_path: Callable[[], Any] = lambda: None) -> None:
        """weight_path(): the engine's engine.cpu_weights.WeightPath, or None (then the
        cpu_weights metrics report nothing)."""
        self.tracer = telemetry.tracer("llmserve.engine")
        self.weight_path = weight_path
        self.m = telemetry.instruments("llmserve.engine", METRICS, self._observe)

    def _observe(self, key: str) -> list[tuple[float, dict[str, str]]]:
        path = self.weight_path()
        if path is None:
            return []
        if key == "cpu_dense_rows":
            attrs = {"path": path.name, "dtype": path.dtype or "none", "reason": path.reason}
            return [(float(path.dense_rows), attrs)]
        return [(float(n), {"path": name}) for name, n in path.steps.items()]

    def on_step(
        self,
        plan: engine_pb2.StepPlan,
        start_ns: int,
        forward_ms: float,
        sample_ms: float,
        total_ms: float,
    ) -> None:
        self.m.forward.record(forward_ms / 1e3)
        self.m.sample.record(sample_ms / 1e3)
        self.m.step.record(total_ms / 1e3)
        num_tokens = sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
            plan.running.num_scheduled_tokens
        )
        self.m.tokens.add(num_tokens)
        if plan.trace_context:
            self._trace(plan, num_tokens, start_ns, forward_ms, sample_ms, total_ms)

    def _trace(
        self,
        plan: engine_pb2.StepPlan,
        num_tokens: int,
        start_ns: int,
        forward_ms: float,
        sample_ms: float,
        total_ms: float,
    ) -> None:
        """The step ran prepare -> forward -> sample; child spans are placed in that order from
        the measured durations (the step's own start and end are exact)."""
        end_ns = start_ns + int(total_ms * 1e6)
        batch_size = len(plan.new_requests) + len(plan.running.seq_ids)
        span: Any = self.tracer.start_span(
            "engine.step",
            context=telemetry.extract(plan.trace_context),
            start_time=start_ns,
            attributes={
                "llmserve.step_id": plan.step_id,
                "llmserve.batch_size": batch_size,
                "llmserve.num_tokens": num_tokens,
                "llmserve.num_new_requests": len(plan.new_requests),
                "llmserve.forward_ms": forward_ms,
                "llmserve.sample_ms": sample_ms,
            },
        )
        ctx = telemetry.context_with(span)
        sample_start = end_ns - int(sample_ms * 1e6)
        forward_start = sample_start - int(forward_ms * 1e6)
        for name, t0, t1 in (
            ("engine.forward", forward_start, sample_start),
            ("engine.sample", sample_start, end_ns),
        ):
            self.tracer.start_span(name, context=ctx, start_time=max(t0, start_ns)).end(end_time=t1)
        span.end(end_time=end_ns)


def now_ns() -> int:
    return time.time_ns()
