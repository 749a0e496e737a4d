"""Telemetry through the three real processes: the span tree of a request (one trace from the
caller's traceparent through gateway, scheduler and engine, phases in order, preemptions visible),
step spans linked to requests, and /metrics counters equal to what the clients saw."""

from __future__ import annotations

import itertools
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from llmserve.bench.otlp import OtlpReceiver, Span
from llmserve.client import Client, Completion, make_request
from llmserve.common import telemetry
from llmserve.common.model_config import load_model_config
from llmserve.engine.kv.cache import bytes_per_token
from tests.stack import Stack, free_port, start_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

CALLER_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
PROMPTS = [f"request {i}: " + "abcdefgh" * (2 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def traced(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[OtlpReceiver, list[Completion], Path]]:
    """Six concurrent requests through a pool of 8 blocks (preemptions) with a 16-token budget
    (chunked prefill), exporting spans to a receiver; request 0 carries a caller's traceparent."""
    receiver = OtlpReceiver().start()
    log_dir = tmp_path_factory.mktemp("logs")
    stack = start_stack(
        model_dir,
        engine_args=["--num-kv-blocks", "8"],
        scheduler_args=["--no-prefix-caching", "--max-num-batched-tokens", "16"],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        log_dir=log_dir,
    )
    traceparent = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"

    def run(i: int) -> Completion:
        request = make_request(
            text=PROMPTS[i], max_tokens=24, temperature=0.0, ignore_eos=True, request_id=f"r{i}"
        )
        metadata = [("traceparent", traceparent)] if i == 0 else None
        completion = Completion()
        with Client(stack.gateway_address) as client:
            for msg in client.stub.Generate(request, metadata=metadata, timeout=60):
                completion.add(msg)
        return completion

    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            completions = list(pool.map(run, range(len(PROMPTS))))
        assert stack.assert_idle().num_preemptions > 0
        assert receiver.wait_for(
            lambda spans: (
                sum(s.name == "llmserve.generate" for s in spans) == len(PROMPTS)
                and sum(s.name == "llmserve.scheduler.request" for s in spans) == len(PROMPTS)
            )
        ), stack.logs()
    finally:
        stack.close()
    yield receiver, completions, log_dir
    receiver.stop()


def _request_spans(spans: list[Span], request_id: str) -> list[Span]:
    root = next(
        s
        for s in spans
        if s.name == "llmserve.generate" and s.attributes.get("llmserve.request_id") == request_id
    )
    return sorted((s for s in spans if s.trace_id == root.trace_id), key=lambda s: s.start_ns)


def test_one_trace_per_request_across_services(traced: tuple) -> None:
    receiver, completions, _ = traced
    assert all(c.completion_tokens == 24 for c in completions)
    trace_ids = set()
    for i in range(len(PROMPTS)):
        spans = _request_spans(receiver.spans, f"r{i}")
        by_name = {s.name: s for s in spans}
        assert {s.service for s in spans} == {"llmserve-gateway", "llmserve-scheduler"}
        gateway, scheduler = by_name["llmserve.generate"], by_name["llmserve.scheduler.request"]
        # gateway -> scheduler parentage crosses the process boundary in gRPC metadata
        assert scheduler.parent_span_id == gateway.span_id
        assert by_name["gateway.validate"].parent_span_id == gateway.span_id
        for s in spans:
            if s.name.startswith("scheduler.") and s is not scheduler:
                assert s.parent_span_id == scheduler.span_id, s.name
        assert gateway.attributes["gen_ai.usage.output_tokens"] == 24
        trace_ids.add(gateway.trace_id)
    assert len(trace_ids) == len(PROMPTS)
    # The caller's trace continues: request 0's gateway span is a child of the caller's span.
    first = _request_spans(receiver.spans, "r0")
    assert first[0].trace_id == CALLER_TRACE_ID
    assert next(s for s in first if s.name == "llmserve.generate").parent_span_id == CALLER_SPAN_ID


def test_log_lines_carry_request_and_trace_ids(traced: tuple) -> None:
    receiver, _, log_dir = traced
    roots = {s.attributes["llmserve.request_id"]: s.trace_id for s in receiver.spans
             if s.name == "llmserve.generate"}  # fmt: skip
    for service in ("gateway", "scheduler"):
        lines = [json.loads(line) for line in (log_dir / f"{service}.log").read_text().splitlines()
                 if line.startswith("{") and '"request_id"' in line]  # fmt: skip
        seen = {line["request_id"] for line in lines}
        assert {f"r{i}" for i in range(len(PROMPTS))} <= seen, service
        for line in lines:
            assert line["trace_id"] == roots[line["request_id"]], line
        assert not any(PROMPTS[0] in json.dumps(line) for line in lines), "prompt text logged"


def test_phases_in_order_and_preemptions_visible(traced: tuple) -> None:
    receiver, _, _ = traced
    num_preempted = 0
    for i in range(len(PROMPTS)):
        spans = _request_spans(receiver.spans, f"r{i}")
        phases = [s for s in spans if s.name in PHASES]
        names = [s.name for s in phases]
        assert names[:3] == ["gateway.validate", "scheduler.queue", "scheduler.prefill"], names
        for a, b in itertools.pairwise(phases):
            assert a.end_ns <= b.start_ns + 1_000_000, f"{a.name} overlaps {b.name}"
        # After a preemption the request is recomputed: prefill again, then decode again.
        for j, name in enumerate(names):
            if name == "scheduler.preempted":
                num_preempted += 1
                assert names[j + 1] == "scheduler.prefill"
                assert phases[j + 1].attributes["llmserve.recompute"] is True
        assert names[-1] == "scheduler.decode"
        root = next(s for s in spans if s.name == "llmserve.scheduler.request")
        assert ("finish", {"llmserve.finish_reason": "length"}) in root.events
        assert root.attributes["llmserve.num_preemptions"] == names.count("scheduler.preempted")
        assert root.attributes["llmserve.num_steps"] >= 24
    assert num_preempted > 0


PHASES = (
    "gateway.validate",
    "scheduler.queue",
    "scheduler.prefill",
    "scheduler.decode",
    "scheduler.preempted",
)


def test_step_spans_link_to_requests_and_hold_engine_spans(traced: tuple) -> None:
    receiver, _, _ = traced
    spans = receiver.spans
    roots = {s.span_id for s in spans if s.name == "llmserve.scheduler.request"}
    steps = [s for s in spans if s.name == "scheduler.step"]
    assert steps
    for step in steps:
        assert {span_id for _, span_id in step.links} <= roots
        assert len(step.links) == step.attributes["llmserve.batch_size"]
    by_parent: dict[str, list[Span]] = {}
    for s in spans:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    engine_steps = [s for s in spans if s.name == "engine.step"]
    assert len(engine_steps) == len(steps)
    step_ids = {s.span_id for s in steps}
    for es in engine_steps:
        assert es.parent_span_id in step_ids and es.service == "llmserve-engine"
        children = sorted(by_parent[es.span_id], key=lambda s: s.start_ns)
        assert [c.name for c in children] == ["engine.forward", "engine.sample"]
        assert es.start_ns <= children[0].start_ns and children[-1].end_ns <= es.end_ns


# -- metrics -----------------------------------------------------------------------------------


def _scrape(port: int) -> dict[str, float]:
    """name{label=value,...} -> value for every sample at /metrics."""
    return _scrape_url(f"http://127.0.0.1:{port}/metrics")


def _scrape_url(url: str) -> dict[str, float]:
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            labels = ",".join(
                f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in IGNORED_LABELS
            )
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


IGNORED_LABELS = {"otel_scope_name", "otel_scope_version", "otel_scope_schema_url", "job"}


def _total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of samples of name whose labels include the given ones."""
    total = 0.0
    for key, value in metrics.items():
        metric, _, rest = key.partition("{")
        have = dict(kv.split("=", 1) for kv in rest.rstrip("}").split(",") if kv)
        if metric == name and all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


@pytest.fixture(scope="module")
def metrics_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    ports = {name: free_port() for name in ("gateway", "scheduler", "engine")}
    stack = start_stack(
        model_dir,
        engine_args=[
            "--num-kv-blocks",
            "64",
            "--metrics-port",
            str(ports["engine"]),
            "--kv-offload-gb",
            "0.01",
        ],
        scheduler_args=["--metrics-port", str(ports["scheduler"])],
        gateway_args=["--metrics-port", str(ports["gateway"])],
        log_dir=tmp_path_factory.mktemp("logs"),
        http=True,
    )
    yield stack, ports
    stack.close()


def test_metrics_match_what_clients_saw(
    metrics_stack: tuple[Stack, dict[str, int]], model_dir: Path
) -> None:
    stack, ports = metrics_stack
    requests = [
        make_request(text=p, max_tokens=3 + i, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    with stack.client() as client, ThreadPoolExecutor(4) as pool:
        done = list(pool.map(client.generate, requests))
        # One stopped by a stop token id (the first token greedy decoding gives), one invalid.
        first = done[0].token_ids[0]
        stopped = client.generate(
            make_request(text=PROMPTS[0], max_tokens=8, temperature=0.0, stop_token_ids=[first])
        )
        with pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(text="x", max_tokens=0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stopped.finish_reason == "stop" and stopped.completion_tokens == 1
    done.append(stopped)
    stack.assert_idle()
    num_prompt = sum(c.prompt_tokens for c in done)
    num_generated = sum(c.completion_tokens for c in done)
    gw = _scrape(ports["gateway"])
    assert stack.http_url is not None  # the same metrics on the HTTP API's port (aiperf's)
    on_http = _scrape_url(stack.http_url.removesuffix("/v1") + "/metrics")
    assert {k: v for k, v in on_http.items() if k.startswith("gen_ai")} == {
        k: v for k, v in gw.items() if k.startswith("gen_ai")
    }
    n = len(done)
    assert _total(gw, "gen_ai_server_time_to_first_token_seconds_count") == n
    # (the request stopped after one token has no time per output token)
    assert _total(gw, "gen_ai_server_time_per_output_token_seconds_count") == n - 1
    assert _total(gw, "gen_ai_server_request_duration_seconds_count") == n + 1
    assert (
        _total(gw, "gen_ai_server_request_duration_seconds_count", error_type="INVALID_ARGUMENT")
        == 1
    )
    assert _total(gw, "llmserve_gateway_requests_total", finish_reason="length") == n - 1
    assert _total(gw, "llmserve_gateway_requests_total", finish_reason="stop") == 1
    assert _total(gw, "llmserve_gateway_requests_total", status_code="INVALID_ARGUMENT") == 1
    assert _total(gw, "llmserve_gateway_prompt_tokens_total") == num_prompt
    assert _total(gw, "llmserve_gateway_generation_tokens_total") == num_generated
    assert _total(gw, "gen_ai_client_token_usage_sum", gen_ai_token_type="output") == num_generated
    assert _total(gw, "gen_ai_client_token_usage_sum", gen_ai_token_type="input") == num_prompt
    sc = _scrape(ports["scheduler"])
    assert _total(sc, "llmserve_scheduler_requests_finished_total") == n
    assert _total(sc, "llmserve_scheduler_requests_finished_total", finish_reason="stop") == 1
    assert _total(sc, "llmserve_scheduler_generation_tokens_total") == num_generated
    assert _total(sc, "llmserve_scheduler_prompt_tokens_total") == num_prompt
    assert _total(sc, "llmserve_request_queue_time_seconds_count") == n
    assert _total(sc, "llmserve_request_prefill_time_seconds_count") == n
    assert _total(sc, "llmserve_scheduler_requests_running") == 0
    assert _total(sc, "llmserve_kv_cache_usage") == 0
    assert _total(sc, "llmserve_kv_cache_blocks_free") == 64
    # The pool's bytes per token, as the engine lays it out (float32 on the CPU)
    per_token = bytes_per_token(load_model_config(model_dir), torch.float32)
    assert _total(sc, "llmserve_kv_cache_token_size_bytes") == per_token > 0
    assert stack.stats().kv_bytes_per_token == per_token
    # Every step the scheduler planned is one the engine ran and the scheduler timed. With
    # overlap a step planned ahead of the last result (for a request that had just finished)
    # may still be in flight when the scheduler turns idle: it is counted as planned at once,
    # as run and timed a moment later, so read all sides once they have settled.
    deadline = time.monotonic() + 10
    while True:
        planned = stack.stats()
        steps = _total(
            _scrape(ports["scheduler"]), "llmserve_scheduler_step_duration_seconds_count"
        )
        en = _scrape(ports["engine"])
        forwards = _total(en, "llmserve_engine_forward_duration_seconds_count")
        tokens = _total(en, "llmserve_engine_tokens_total")
        settled = forwards == steps == planned.num_steps
        if (settled and tokens == planned.num_scheduled_tokens) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert steps >= max(c.completion_tokens for c in done)
    assert forwards == steps == planned.num_steps
    assert tokens == planned.num_scheduled_tokens
    # KV offload: the host tier's counts, one series per tier, as GetStats has them.
    assert planned.kv_offload_num_blocks["host"] > 0
    for tier in ("host", "disk"):
        assert (
            _total(sc, "llmserve_kv_offload_hit_blocks_total", tier=tier)
            == (planned.kv_offload_hit_blocks[tier])
        )
    assert (
        _total(sc, "llmserve_kv_offload_blocks_copied_total", tier="host")
        == (planned.kv_offload_blocks_in["host"])
    )
    assert _total(sc, "llmserve_kv_offload_swap_ins_total") == planned.num_swap_ins
    swap_in_waits = _total(sc, "llmserve_kv_offload_swap_in_duration_seconds_count")
    assert swap_in_waits == planned.num_swap_ins


# -- configuration -------------------------------------------------------------------------------


def test_exporters_follow_otel_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert telemetry._exporters("traces") == set()  # nothing configured: no exporter, no cost
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert telemetry._exporters("traces") == {"otlp"}
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry._exporters("traces") == set()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,otlp")
    assert telemetry._exporters("traces") == {"console", "otlp"}


def test_trace_context_round_trips_through_headers() -> None:
    parent = f"00-{CALLER_TRACE_ID}-{CALLER_SPAN_ID}-01"
    ctx = telemetry.extract([("traceparent", parent), ("other", "x")])
    from opentelemetry import trace

    span_context = trace.get_current_span(ctx).get_span_context()
    assert f"{span_context.trace_id:032x}" == CALLER_TRACE_ID
    assert telemetry.extract([("other", "x")]) is None
    assert telemetry.inject(None) == {}
