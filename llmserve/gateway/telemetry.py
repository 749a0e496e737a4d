"""What the gateway tells OpenTelemetry: the root span of each request and the client-facing
latency metrics (OpenTelemetry GenAI semantic conventions where they exist).

    llmserve.generate        SERVER span: arrival -> last message (child of the caller's span
      gateway.validate       when a traceparent came in); chat template, tokenization, validation

The scheduler's spans hang under llmserve.generate: its context goes out in the Submit call's
metadata. Prompt text is logged only with LLMSERVE_LOG_PROMPTS=1.
"""

from __future__ import annotations

import os
import time
from typing import Any

from llmserve.common import telemetry
from llmserve.common.log import bind, get_logger
from llmserve.common.telemetry import Metric
from llmserve.gateway.tenants import display_name
from llmserve.gateway.validation import ValidRequest
from llmserve.protos import api_pb2, common_pb2

log = get_logger("gateway")

FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_GRAMMAR_DEAD_END: "grammar_dead_end",
}


_LAT = telemetry.LATENCY_BUCKETS_S
METRICS = {
    "ttft": Metric(
        "gen_ai.server.time_to_first_token", "histogram", "s",
        "Arrival at the gateway to the first generated token sent", _LAT,
    ),
    "tpot": Metric(
        "gen_ai.server.time_per_output_token", "histogram", "s",
        "(end-to-end - time to first token) / (output tokens - 1), per request",
        telemetry.TOKEN_LATENCY_BUCKETS_S,
    ),
    "duration": Metric(
        "gen_ai.server.request.duration", "histogram", "s",
        "Arrival to the last message (end-to-end latency); error.type on failures", _LAT,
    ),
    "token_usage": Metric(
        "gen_ai.client.token.usage", "histogram", "{token}",
        "Tokens per request, by gen_ai.token.type (input, output)", telemetry.COUNT_BUCKETS,
    ),
    "requests": Metric(
        "llmserve.gateway.requests", "counter", "{request}",
        "Requests ended, by finish_reason (stop, length, abort, error) and status_code (OK or "
        "the gRPC status)",
    ),
    "prompt_tokens": Metric(
        "llmserve.gateway.prompt_tokens", "counter", "{token}", "Prompt tokens"
    ),
    "generation_tokens": Metric(
        "llmserve.gateway.generation_tokens", "counter", "{token}", "Tokens generated"
    ),
    "refused": Metric(
        "llmserve.gateway.refused_requests", "counter", "{request}",
        "Requests refused at admission, by tenant and reason (tokens_per_minute, "
        "max_concurrent_requests, too_large: over a quota's limit itself, draining)",
    ),
}  # fmt: skip


class GatewayTelemetry:
    def __init__(self) -> None:
        self.tracer = telemetry.tracer("llmserve.gateway")
        self.log_prompts = os.environ.get("LLMSERVE_LOG_PROMPTS", "") in ("1", "true", "yes")
        self.model = ""
        self.m = telemetry.instruments("llmserve.gateway", METRICS)

    def start(
        self, carrier: Any, request_id: str, api: str, start: float | None = None
    ) -> RequestTelemetry:
        """A request arrived (carrier: gRPC metadata or HTTP headers, for a traceparent; start:
        its monotonic arrival time when earlier than now)."""
        return RequestTelemetry(self, telemetry.extract(carrier), request_id, api, start)

    def rejected(self, code: str, api: str, start: float) -> None:
        """A request refused before it had a RequestTelemetry (an invalid HTTP body)."""
        attrs = {"gen_ai.request.model": self.model, "llmserve.api": api, "error.type": code}
        self.m.duration.record(time.monotonic() - start, attrs)
        self.m.requests.add(1, {"finish_reason": "error", "status_code": code})

    def refused(self, tenant: str, reason: str) -> None:
        """A request refused at admission (a quota, or a draining gateway)."""
        self.m.refused.add(1, {"tenant": display_name(tenant), "reason": reason})
        log.info("request refused", tenant=display_name(tenant), reason=reason)


class RequestTelemetry:
    """One request's span and timings. `finish` ends it, once."""

    def __init__(
        self, owner: GatewayTelemetry, parent: Any, request_id: str, api: str, start: float | None
    ):
        self.owner = owner
        self.start = time.monotonic() if start is None else start
        self.first_token: float | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.operation = "text_completion"
        self.attributes = {"gen_ai.request.model": owner.model, "llmserve.api": api}
        self.span: Any = None
        self.validate_span: Any = None
        self.done = False
        if telemetry.tracing_enabled():
            from opentelemetry.trace import SpanKind

            self.span = owner.tracer.start_span(
                "llmserve.generate",
                context=parent,
                kind=SpanKind.SERVER,
                attributes={"llmserve.request_id": request_id, "llmserve.api": api},
            )
            self.validate_span = owner.tracer.start_span(
                "gateway.validate", context=telemetry.context_with(self.span)
            )
        bind(request_id=request_id, trace_id=telemetry.trace_id_hex(self.span))

    def validated(self, valid: ValidRequest, request: api_pb2.GenerateRequest | None) -> None:
        """Validation passed (request: the original, for its kind and, if asked, logging)."""
        self.num_prompt_tokens = len(valid.prompt_token_ids)
        if request is not None:
            self.operation = "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
            if self.owner.log_prompts:
                log.info("prompt", prompt=request.text or str(list(request.chat.messages)))
        if self.validate_span is not None:
            self.validate_span.set_attribute("gen_ai.usage.input_tokens", self.num_prompt_tokens)
            self.validate_span.end()
            self.validate_span = None
            self.span.set_attributes(
                {
                    "gen_ai.operation.name": self.operation,
                    "gen_ai.usage.input_tokens": self.num_prompt_tokens,
                    "gen_ai.request.max_tokens": valid.submit.max_tokens,
                }
            )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Trace context for the Submit call."""
        return tuple(telemetry.inject(self.span).items())

    def on_response(self, msg: api_pb2.GenerateResponse) -> None:
        if msg.token_ids and self.first_token is None:
            self.first_token = time.monotonic()
            self.owner.m.ttft.record(self.first_token - self.start, self.attributes)
            if self.span is not None:
                self.span.add_event("first_token")
        self.num_output_tokens += len(msg.token_ids)

    def finish(self, finish_reason: int = 0, code: str = "OK", message: str = "") -> None:
        """The request ended: with a finish reason, or with a gRPC status code name."""
        if self.done:
            return
        self.done = True
        end = time.monotonic()
        o = self.owner.m
        reason = FINISH_REASONS.get(finish_reason, "error" if code != "OK" else "abort")
        attrs = {**self.attributes, "gen_ai.operation.name": self.operation}
        if code == "OK":
            o.token_usage.record(self.num_prompt_tokens, {**attrs, "gen_ai.token.type": "input"})
            o.token_usage.record(self.num_output_tokens, {**attrs, "gen_ai.token.type": "output"})
        else:
            attrs["error.type"] = code
        o.duration.record(end - self.start, attrs)
        o.requests.add(1, {"finish_reason": reason, "status_code": code})
        o.prompt_tokens.add(self.num_prompt_tokens)
        o.generation_tokens.add(self.num_output_tokens)
        if self.first_token is not None and self.num_output_tokens > 1:
            o.tpot.record((end - self.first_token) / (self.num_output_tokens - 1), attrs)
        log.info(
            "request finished",
            finish_reason=reason,
            status_code=code,
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=self.num_output_tokens,
            e2e_s=round(end - self.start, 4),
        )
        if self.span is None:
            return
        if self.validate_span is not None:
            self.validate_span.end()
        self.span.add_event("finish", {"llmserve.finish_reason": reason})
        self.span.set_attributes(
            {
                "llmserve.finish_reason": reason,
                "rpc.grpc.status_code": code,
                "gen_ai.usage.output_tokens": self.num_output_tokens,
            }
        )
        if code != "OK":
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
        self.span.end()
