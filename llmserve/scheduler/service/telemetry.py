"""What the scheduler tells OpenTelemetry: a span tree per request, a span per step, and metrics.

A request's spans (scheduler.request with its queue, prefill, decode and preempted phases) are
children of the gateway's span when its trace context came in the metadata; each step is a root
span `scheduler.step`, linked to the requests it served, whose child is the engine's
`engine.step` (the context travels in the StepPlan). Phase spans are made when a step's result
arrives, so they do not overlap even with two steps in flight. Timing spans are made only when
tracing is on; the metrics are always kept (a few dict and histogram updates per step).
The tree and its timing rules: docs/observability.md#traces.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmserve.common import telemetry
from llmserve.scheduler.disagg.transfers import KVMove
from llmserve.scheduler.plan import NewRequestRow, RunningRow, StepOutcome, StepPlan
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.service.metrics import METRICS


@dataclass
class RequestTelemetry:
    """Per-request timestamps (monotonic seconds) and open spans."""

    arrival: float
    first_scheduled: float | None = None
    num_steps: int = 0
    min_batch_size: int = 0
    max_batch_size: int = 0
    sum_batch_size: int = 0
    max_num_blocks: int = 0
    root: Any = None
    phase: Any = None  # the open queue / decode / preempted span
    phase_name: str = ""

    def saw_batch(self, batch_size: int) -> None:
        self.num_steps += 1
        self.sum_batch_size += batch_size
        self.max_batch_size = max(self.max_batch_size, batch_size)
        self.min_batch_size = min(self.min_batch_size or batch_size, batch_size)


@dataclass
class StepTelemetry:
    """A step in flight (tracing only): when it was planned (wall-clock ns) and its span."""

    planned_ns: int
    span: Any


def is_decode_row(row: NewRequestRow | RunningRow) -> bool:
    """One token, an output token (the newest sampled one, maybe still pending), that samples."""
    return (
        row.num_scheduled_tokens == 1
        and row.samples
        and row.num_computed_tokens >= row.request.num_prompt_tokens
    )


def _spec_ratios(stats: dict[str, Any], key: str) -> list[tuple[float, dict[str, str]]]:
    """The acceptance rate or the mean accepted length from the stats' counts (nothing before
    the first verification)."""
    rows, draft = stats.get("num_spec_rows", 0), stats.get("num_spec_draft_tokens", 0)
    accepted = stats.get("num_spec_accepted_tokens", 0)
    if not rows:
        return []
    if key == "spec_acceptance_rate":
        return [(accepted / draft, {})]
    return [(1.0 + accepted / rows, {})]


MAX_TENANT_SERIES = 64  # tenants come from clients (`user`): bound the metrics' cardinality


def _tenant_series(tenants: list[Any], key: str) -> list[tuple[float, dict[str, str]]]:
    """Per-tenant series for the MAX_TENANT_SERIES tenants served most (weighted)."""
    top = sorted(tenants, key=lambda t: t.virtual_tokens * t.weight, reverse=True)
    top = top[:MAX_TENANT_SERIES]
    if key == "tenant_virtual_tokens":
        return [(t.virtual_tokens, {"tenant": t.tenant}) for t in top]
    return [
        (n, {"tenant": t.tenant, "kind": kind})
        for t in top
        for kind, n in (("prompt", t.num_prompt_tokens), ("generated", t.num_generated_tokens))
    ]


class SchedulerTelemetry:
    def __init__(self, stats: Callable[[], dict[str, Any]] = dict):
        """stats: the service's stats snapshot (counts and gauges), read by the observed
        instruments when metrics are collected."""
        self.tracer = telemetry.tracer("llmserve.scheduler")
        self.tracing = telemetry.tracing_enabled()
        self.requests: dict[int, RequestTelemetry] = {}
        self.stats = stats
        # Steps in flight by step id (tracing only), and the last result's wall-clock time.
        self.steps: dict[int, StepTelemetry] = {}
        self.last_result_ns = 0
        # Preemptions not yet shown in traces: (id of the step planned when it happened, request).
        self.preemptions: list[tuple[int, Request]] = []
        # (time, generated tokens so far) at recent readings, for the throughput gauge.
        self.readings: deque[tuple[float, float]] = deque()
        self.m = telemetry.instruments("llmserve.scheduler", METRICS, self._observe)

    def _observe(self, key: str) -> list[tuple[float, dict[str, str]]]:
        stats = self.stats()
        if "num_blocks" not in stats:  # no engine connected yet
            return []
        if key == "finish_reasons":
            return [(n, {"finish_reason": r}) for r, n in stats["finish_reasons"].items()]
        if key == "num_preemptions":
            by_reason = stats["num_preemptions_by_reason"].items()
            return [(n, {"reason": r}) for r, n in by_reason]
        if key.startswith("tenant_"):
            return _tenant_series(stats["tenants"], key)
        if key.startswith("kv_offload_"):
            return [(n, {"tier": tier}) for tier, n in stats.get(key, {}).items()]
        if key == "num_kv_transfers_by_outcome":
            if "num_kv_transfers_done" not in stats:
                return []
            failed = stats["num_kv_transfers_failed"].items()
            return [(stats["num_kv_transfers_done"], {"outcome": "done"})] + [
                (n, {"outcome": reason}) for reason, n in failed
            ]
        if key in ("num_swap_ins", "swap_in_wait_s", "kv_transfer_blocks", "kv_transfer_bytes"):
            return [(stats[key], {})] if key in stats else []
        if key == "kv_usage":
            return [(1.0 - stats["num_free_blocks"] / stats["num_blocks"], {})]
        if key == "throughput":
            return [(self._throughput(stats["num_generated_tokens"]), {})]
        if key.endswith("_per_pos"):
            return [(n, {"position": str(j)}) for j, n in enumerate(stats.get(key, []))]
        if key.startswith("spec_"):
            return _spec_ratios(stats, key)
        return [(stats[key], {})]

    def _throughput(self, num_generated: float, window: float = 10.0) -> float:
        now = time.monotonic()
        self.readings.append((now, num_generated))
        while len(self.readings) > 2 and self.readings[1][0] < now - window:
            self.readings.popleft()
        (t0, n0), (t1, n1) = self.readings[0], self.readings[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # -- request lifecycle --------------------------------------------------------------------

    def on_submit(self, request: Request, metadata: Any) -> str | None:
        """A request was admitted to the queue. Returns its trace id when tracing."""
        rt = RequestTelemetry(arrival=time.monotonic())
        self.requests[request.seq_id] = rt
        if not self.tracing:
            return None
        rt.root = self.tracer.start_span(
            "llmserve.scheduler.request",
            context=telemetry.extract(metadata),
            attributes={
                "llmserve.request_id": request.request_id,
                "llmserve.seq_id": request.seq_id,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                "gen_ai.request.max_tokens": request.max_tokens,
                "llmserve.tenant": request.tenant,
                "llmserve.priority": request.priority,
            },
        )
        self._open_phase(rt, "scheduler.queue")
        return telemetry.trace_id_hex(rt.root)

    def trace_id(self, request: Request) -> str | None:
        """request's trace id (hex) while it is tracked and tracing is on, for log lines made
        outside its own call (preemption, operator abort)."""
        rt = self.requests.get(request.seq_id)
        return telemetry.trace_id_hex(rt.root) if rt is not None and rt.root is not None else None

    def _open_phase(
        self, rt: RequestTelemetry, name: str, start_ns: int | None = None, **attributes: Any
    ) -> None:
        self._close_phase(rt, end_ns=start_ns)
        rt.phase = self.tracer.start_span(
            name,
            context=telemetry.context_with(rt.root),
            attributes=attributes,
            start_time=start_ns,
        )
        rt.phase_name = name

    def _close_phase(self, rt: RequestTelemetry, end_ns: int | None = None) -> None:
        if rt.phase is not None:
            rt.phase.end(end_time=end_ns)
        rt.phase, rt.phase_name = None, ""

    # -- steps --------------------------------------------------------------------------------

    def on_plan(self, plan: StepPlan) -> dict[str, str]:
        """After `schedule`: per-request bookkeeping, the step span. Returns the trace context
        for the StepPlan (empty when not tracing)."""
        now = time.monotonic()
        self.preemptions.extend((plan.step_id, r) for r in plan.preempted)
        rows = plan.rows
        reqs = [self.requests.get(row.request.seq_id) for row in rows]
        for row, rt in zip(rows, reqs, strict=True):
            if rt is None:
                continue
            if self.tracing:  # only the request span's attributes read these
                rt.saw_batch(len(rows))
                rt.max_num_blocks = max(rt.max_num_blocks, len(row.request.block_table))
            if rt.first_scheduled is None:
                rt.first_scheduled = now
                self.m.queue_time.record(now - rt.arrival)
        self.m.batch_size.record(len(rows))
        self.m.step_tokens.record(plan.num_scheduled_tokens)
        context = self._trace_plan(plan, reqs) if self.tracing else {}
        self._show_preemptions()
        return context

    def _trace_plan(self, plan: StepPlan, reqs: list[RequestTelemetry | None]) -> dict[str, str]:
        """Open the step's span; a request scheduled from the queue leaves it now. reqs: the
        telemetry of plan's rows' requests (None: not tracked)."""
        span = self.tracer.start_span(
            "scheduler.step",
            links=telemetry.links([rt.root for rt in reqs if rt is not None]),
            attributes={
                "llmserve.step_id": plan.step_id,
                "llmserve.batch_size": len(reqs),
                "llmserve.num_scheduled_tokens": plan.num_scheduled_tokens,
                "llmserve.num_new_requests": len(plan.new_requests),
                "llmserve.num_finished_seq_ids": len(plan.finished_seq_ids),
            },
        )
        self.steps[plan.step_id] = StepTelemetry(time.time_ns(), span)
        for rt in reqs:
            if rt is not None and rt.phase_name == "scheduler.queue":
                self._close_phase(rt)
        return telemetry.inject(span)

    def on_result(
        self, plan: StepPlan, outcomes: list[StepOutcome], timings: dict[str, float]
    ) -> None:
        """After `update` (results come in step order): end the step's span and make its
        requests' spans. (Finished requests are ended by `on_finish`, called where their stream
        closes.)"""
        now = time.monotonic()
        self.m.step_duration.record(timings["step_s"])
        for outcome in outcomes:
            rt = self.requests.get(outcome.request.seq_id)
            if outcome.request.num_output_tokens == 1 and rt and rt.first_scheduled is not None:
                self.m.prefill_time.record(now - rt.first_scheduled)
        step = self.steps.pop(plan.step_id, None)
        if step is not None:
            self._trace_result(plan, step, timings)
        self._show_preemptions()

    def _trace_result(self, plan: StepPlan, step: StepTelemetry, timings: dict[str, float]) -> None:
        """Step plan's request spans, from its turn (the engine runs steps in order) to now."""
        end_ns = time.time_ns()
        start_ns = max(step.planned_ns, self.last_result_ns)
        self.last_result_ns = end_ns
        step_links = telemetry.links([step.span])
        for row in plan.rows:
            request = row.request
            rt = self.requests.get(request.seq_id)
            if rt is None or rt.root is None:
                continue
            if is_decode_row(row):
                if rt.phase_name != "scheduler.decode":
                    attributes = {"llmserve.step_id": plan.step_id}
                    self._open_phase(rt, "scheduler.decode", start_ns, **attributes)
                continue
            if rt.phase_name == "scheduler.preempted":
                self._close_phase(rt, end_ns=start_ns)
            chunk = self.tracer.start_span(
                "scheduler.prefill",
                context=telemetry.context_with(rt.root),
                links=step_links,
                start_time=start_ns,
                attributes={
                    "llmserve.step_id": plan.step_id,
                    "llmserve.num_tokens": row.num_scheduled_tokens,
                    "llmserve.num_computed_tokens": row.num_computed_tokens,
                    "llmserve.recompute": request.num_preemptions > 0,
                    "llmserve.batch_size": len(plan.rows),
                },
            )
            chunk.end(end_time=end_ns)
        step.span.set_attributes({f"llmserve.{k}": v for k, v in timings.items()})
        step.span.end(end_time=end_ns)

    def on_kv_moves(self, moves: list[KVMove]) -> None:
        """Requests' KV that moved (a transfer to the decode engine, a swap-in), done or
        failed: the histograms, and a span each under its request (tracing)."""
        end_ns = time.time_ns()
        for move in moves:
            if move.kind == "swap_in":
                self.m.swap_in_duration.record(move.seconds)
            elif move.outcome == "done":
                self.m.kv_transfer_duration.record(move.seconds)
                if move.seconds > 0 and move.num_bytes:
                    self.m.kv_transfer_bandwidth.record(move.num_bytes / move.seconds)
            rt = self.requests.get(move.request.seq_id)
            if rt is None or rt.root is None:
                continue
            span = self.tracer.start_span(
                f"scheduler.{move.kind}",
                context=telemetry.context_with(rt.root),
                start_time=end_ns - int(move.seconds * 1e9),
                attributes={
                    "llmserve.num_blocks": move.num_blocks,
                    "llmserve.num_bytes": move.num_bytes,
                    "llmserve.outcome": move.outcome,
                },
            )
            span.end(end_time=end_ns)

    def on_engine_reset(self, preempted: list[Request]) -> None:
        """The engine was lost with steps in flight: their results never come. End their spans
        (marked lost) and show the preemptions that reset_engine made."""
        for step in self.steps.values():
            step.span.set_attribute("llmserve.lost", True)
            step.span.end()
        self.steps.clear()
        self.preemptions.extend((0, r) for r in preempted)
        self._show_preemptions()

    def _show_preemptions(self) -> None:
        """Open the preempted phase of each queued preemption whose earlier steps all reported
        (their spans came first: the engine ran those steps before the preemption)."""
        first_in_flight = min(self.steps, default=math.inf)
        ready = [r for step_id, r in self.preemptions if step_id <= first_in_flight]
        self.preemptions = [p for p in self.preemptions if p[0] > first_in_flight]
        for request in ready:
            rt = self.requests.get(request.seq_id)
            if rt is None or rt.root is None:
                continue
            event: dict[str, Any] = {
                "llmserve.num_output_tokens": request.num_output_tokens,
                "llmserve.preemption.reason": request.preemption.reason,
            }
            rt.root.add_event("preempted", event)
            attributes = {**event, "llmserve.num_preemptions": request.num_preemptions}
            self._open_phase(rt, "scheduler.preempted", **attributes)

    def on_finish(self, request: Request, status: RequestStatus) -> None:
        """The request ended (finished, stopped, aborted): count it, end its spans. Once per
        request."""
        self._show_preemptions()
        rt = self.requests.pop(request.seq_id, None)
        if rt is None or rt.root is None:
            return
        self._close_phase(rt)
        root = rt.root
        root.add_event("finish", {"llmserve.finish_reason": status.value})
        root.set_attributes(
            {
                "llmserve.finish_reason": status.value,
                "gen_ai.usage.output_tokens": request.num_output_tokens,
                "llmserve.num_cached_tokens": request.num_cached_tokens or 0,
                "llmserve.num_preemptions": request.num_preemptions,
                "llmserve.num_steps": rt.num_steps,
                "llmserve.num_blocks.max": rt.max_num_blocks,
                "llmserve.batch_size.min": rt.min_batch_size,
                "llmserve.batch_size.max": rt.max_batch_size,
                "llmserve.batch_size.mean": rt.sum_batch_size / max(rt.num_steps, 1),
            }
        )
        root.end()
