"""A minimal OTLP/gRPC receiver for tests: collects the spans and metrics services export to it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace_id, span_id)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass
class OtlpReceiver:
    port: int = 0
    spans: list[Span] = field(default_factory=list)
    metric_names: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: Any = None

    def start(self) -> OtlpReceiver:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        traces = _Export(self.add_spans, trace_service_pb2.ExportTraceServiceResponse)
        metrics = _Export(self.add_metrics, metrics_service_pb2.ExportMetricsServiceResponse)
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(traces, self.server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(metrics, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=0)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_spans(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                service = str(_attributes(rs.resource.attributes).get("service.name", ""))
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(
                            Span(
                                service=service,
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_span_id=s.parent_span_id.hex(),
                                start_ns=s.start_time_unix_nano,
                                end_ns=s.end_time_unix_nano,
                                attributes=_attributes(s.attributes),
                                events=[(e.name, _attributes(e.attributes)) for e in s.events],
                                links=[(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links],
                            )
                        )

    def add_metrics(self, request: metrics_service_pb2.ExportMetricsServiceRequest) -> None:
        with self.lock:
            for rm in request.resource_metrics:
                for sm in rm.scope_metrics:
                    self.metric_names.update(m.name for m in sm.metrics)

    def wait_for(self, predicate: Callable[[list[Span]], bool], timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if predicate(list(self.spans)):
                    return True
            time.sleep(0.1)
        return False


@dataclass
class _Export:
    """The Export method of an OTLP trace or metrics service: hands each request to add."""

    add: Callable[[Any], None]
    response: Callable[[], Any]

    def Export(self, request: Any, context: Any) -> Any:
        self.add(request)
        return self.response()
