"""OpenTelemetry for every service: traces and metrics, configured by the standard OTEL_* variables
(docs/observability.md).

Traces are exported only when asked for (OTEL_TRACES_EXPORTER, or an OTLP endpoint); otherwise
the tracer is the API's no-op one and `tracing_enabled()` is False, so hot paths skip span
bookkeeping. Metrics always go to an in-process Prometheus registry (served at /metrics when a
metrics port is given), and over OTLP when OTEL_METRICS_EXPORTER=otlp or an endpoint is set.
The W3C trace context crosses processes in gRPC metadata, and scheduler -> engine in each
StepPlan. Without the opentelemetry packages (a bare GPU machine) everything here is a no-op.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from llmserve.common.log import get_logger

try:
    from opentelemetry import metrics, propagate, trace

    HAVE_OTEL = True
except ImportError:  # pragma: no cover - exercised on machines without opentelemetry
    HAVE_OTEL = False

log = get_logger("telemetry")

# Seconds. Fine enough to resolve milliseconds at the low end (issue 5), long enough for CPU runs.
LATENCY_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
# Per-token latencies: decode steps take milliseconds on a GPU, ~0.2 s on two CPU cores.
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Token counts, batch sizes: powers of two.
COUNT_BUCKETS = tuple(float(1 << i) for i in range(0, 18))

_state: dict[str, Any] = {"tracing": False, "configured": False}


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def _exporters(kind: str) -> set[str]:
    """Exporter names for 'traces' or 'metrics' from OTEL_<KIND>_EXPORTER, defaulting to otlp
    only when an OTLP endpoint is configured."""
    value = os.environ.get(f"OTEL_{kind.upper()}_EXPORTER")
    if value is None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
            f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT"
        )
        return {"otlp"} if endpoint else set()
    names = {v.strip().lower() for v in value.split(",") if v.strip()}
    return set() if "none" in names else names


def setup(
    service: str, metrics_port: int = 0, metrics_host: str = "0.0.0.0", registry: bool = False
) -> None:
    """Install this process's tracer and meter providers (once). metrics_port > 0 serves
    Prometheus text at /metrics on that port; a port that is taken is logged, not fatal.
    registry: fill prometheus_client's registry even without that port (the gateway serves it
    at /metrics on its HTTP port too)."""
    if _state["configured"] or not HAVE_OTEL or _env_flag("OTEL_SDK_DISABLED"):
        return
    _state["configured"] = True
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    resource = Resource({"service.name": f"llmserve-{service}"}).merge(
        OTELResourceDetector().detect()
    )
    _setup_tracing(resource, _exporters("traces"))
    _setup_metrics(resource, _exporters("metrics"), metrics_port, metrics_host, registry)


def _setup_tracing(resource: Any, exporters: set[str]) -> None:
    if not exporters:
        return
    from opentelemetry.sdk.trace import SpanLimits, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    # A step span links to every request in its batch: allow a large batch's worth.
    provider = TracerProvider(resource=resource, span_limits=SpanLimits(max_links=1024))
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("unknown OTEL_TRACES_EXPORTER ignored", exporter=name)
    trace.set_tracer_provider(provider)
    _state["tracing"] = True
    log.info("tracing on", exporters=sorted(exporters))


def _setup_metrics(
    resource: Any, exporters: set[str], port: int, host: str, registry: bool = False
) -> None:
    from opentelemetry.sdk.metrics import MeterProvider

    readers: list[Any] = []
    if port > 0:
        readers.append(_prometheus_reader(port, host))
    if registry and (port <= 0 or readers[-1] is None):
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers.append(PrometheusMetricReader())
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
            from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name != "prometheus":
            log.warning("unknown OTEL_METRICS_EXPORTER ignored", exporter=name)
    metrics.set_meter_provider(
        MeterProvider(resource=resource, metric_readers=[r for r in readers if r is not None])
    )


def _prometheus_reader(port: int, host: str) -> Any:
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host)
    except OSError as err:
        log.error("cannot serve /metrics", address=f"{host}:{port}", error=str(err))
        return None
    log.info("metrics served", url=f"http://{host}:{port}/metrics")
    return PrometheusMetricReader()


def tracing_enabled() -> bool:
    return bool(_state["tracing"])


def tracer(name: str) -> Any:
    return trace.get_tracer(name) if HAVE_OTEL else _NoOp()


# -- instruments ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    """One instrument of a service's table. kind: "histogram" and "counter" are recorded as
    events happen; "observed_counter" (a cumulative count) and "gauge" are read when metrics are
    collected, through the `observe(key)` callback given to `instruments`."""

    name: str
    kind: str
    unit: str
    description: str
    buckets: Sequence[float] = ()


def instruments(
    meter_name: str,
    table: Mapping[str, Metric],
    observe: Callable[[str], Iterable[tuple[float, Mapping[str, str]]]] | None = None,
) -> Any:
    """The table's instruments as attributes named by its keys (histograms and counters; the
    observed ones only exist in the meter). observe(key) yields (value, attributes) pairs."""
    m = metrics.get_meter(meter_name) if HAVE_OTEL else _NoOp()
    made: dict[str, Any] = {}
    for key, spec in table.items():
        common = {"unit": spec.unit, "description": spec.description}
        if spec.kind == "histogram":
            made[key] = m.create_histogram(
                spec.name, explicit_bucket_boundaries_advisory=list(spec.buckets), **common
            )
        elif spec.kind == "counter":
            made[key] = m.create_counter(spec.name, **common)
        else:
            assert observe is not None, f"{key}: an observed instrument needs observe"
            callbacks = [functools.partial(_observations, observe, key)]
            if spec.kind == "observed_counter":
                m.create_observable_counter(spec.name, callbacks=callbacks, **common)
            else:
                m.create_observable_gauge(spec.name, callbacks=callbacks, **common)
    return SimpleNamespace(**made)


def _observations(
    observe: Callable[[str], Iterable[tuple[float, Mapping[str, str]]]], key: str, _options: Any
) -> list[Any]:
    from opentelemetry.metrics import Observation

    return [Observation(value, dict(attrs)) for value, attrs in observe(key)]


# -- context propagation -------------------------------------------------------------------------


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Any:
    """A parent context from W3C headers (gRPC metadata pairs or a dict); None without any."""
    if not HAVE_OTEL or carrier is None:
        return None
    items = carrier.items() if isinstance(carrier, Mapping) else carrier
    headers = {k: v for k, v in items if k in ("traceparent", "tracestate")}
    return propagate.extract(headers) if headers else None


def inject(span: Any) -> dict[str, str]:
    """W3C headers naming span as the parent (empty when tracing is off)."""
    if not HAVE_OTEL or span is None or not span.get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def context_with(span: Any) -> Any:
    return trace.set_span_in_context(span) if HAVE_OTEL and span is not None else None


def trace_id_hex(span: Any) -> str | None:
    if not HAVE_OTEL or span is None:
        return None
    ctx = span.get_span_context()
    return f"{ctx.trace_id:032x}" if ctx.is_valid else None


def links(spans: Sequence[Any]) -> list[Any]:
    """Links to the given spans (for a step span: the requests it served)."""
    if not HAVE_OTEL:
        return []
    contexts = [span.get_span_context() for span in spans if span is not None]
    return [trace.Link(ctx) for ctx in contexts if ctx.is_valid]


def shutdown() -> None:
    """Flush exporters (on a clean stop)."""
    if not HAVE_OTEL or not _state["configured"]:
        return
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider()):
        stop = getattr(provider, "shutdown", None)
        if stop is not None:
            try:
                stop()
            except Exception as err:  # an exporter that cannot flush must not block shutdown
                log.warning("telemetry shutdown failed", error=str(err))


class _NoOp:
    """Stands in for tracers, meters, instruments and spans when opentelemetry is missing."""

    def __getattr__(self, name: str) -> Any:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self
