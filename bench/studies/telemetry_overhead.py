"""Issue 5's overhead check: what telemetry costs in throughput.

    python -m bench.studies.telemetry_overhead [--rounds 2]
        [--out bench/results/telemetry_overhead.json]

Three settings, run in alternating rounds on freshly started stacks:
  off      OTEL_SDK_DISABLED=true and no /metrics: no telemetry at all;
  default  what a user gets with no OTEL_* set: metrics kept and served at /metrics, no traces;
  tracing  every span exported over OTLP to a receiver in this process (sampler always on).
Two end-to-end workloads (their run-to-run spread on a 2-core VM is several percent, more than
the effect, so the script also times the telemetry hooks themselves, in-process, with the SDK as
`default` configures it, and states their cost as a fraction of the CPU benchmark's step):
  model bench/studies/cpu_stack.py's: built-in SmolLM2-135M on the CPU, 16 streams x 128 in / 128
  out
           (the benchmark the issue names; steps take ~200 ms, so per-step costs hide);
  echo     the echo engine (no model, steps take well under a millisecond), 64 streams x 256
           tokens: scheduler, gateway and gRPC only, where a per-step or per-token cost shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.studies.cpu_stack import bench_stack
from llmserve.bench.otlp import OtlpReceiver
from llmserve.bench.report import hardware, save
from llmserve.bench.workload import exact_length_prompt_ids
from llmserve.client import Client, make_request
from llmserve.common.model_config import builtin_model_path
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.serve_flags import serve_locally
from llmserve.topology import free_port

ROOT = Path(__file__).resolve().parents[2]

SETTINGS = ("off", "default", "tracing")


def settings_env(setting: str, receiver: OtlpReceiver) -> dict[str, str]:
    if setting == "off":
        return {"OTEL_SDK_DISABLED": "true", "LLMSERVE_METRICS_PORT": "0"}
    if setting == "default":
        return {}
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_METRICS_EXPORTER": "none"}


def bench_echo(env: dict[str, str], num_streams: int, num_tokens: int) -> float:
    """Output tokens/s of num_streams concurrent echo requests through the three processes."""
    fake = EchoEngineConfig(vocab_size=49152)  # SmolLM2's vocabulary
    metrics = env.get("LLMSERVE_METRICS_PORT") != "0"  # metrics on, as by default
    with serve_locally([], 120, env=env, metrics=metrics, fake=fake) as stack:
        prompt = "the quick brown fox jumps over the lazy dog " * 8
        request = make_request(text=prompt, max_tokens=num_tokens, ignore_eos=True)
        with Client(stack.gateway_address) as client, ThreadPoolExecutor(num_streams) as pool:
            client.generate(make_request(text=prompt, max_tokens=8))  # warm-up
            t0 = time.perf_counter()
            done = list(pool.map(client.generate, [request] * num_streams))
            wall = time.perf_counter() - t0
    assert all(c.completion_tokens == num_tokens for c in done)
    return num_streams * num_tokens / wall


def hook_costs(num_requests: int = 16, num_tokens: int = 128) -> dict[str, float]:
    """Microseconds spent in the telemetry hooks, with metrics on (Prometheus reader, as by
    default) and tracing off: per scheduler step (16 decoding requests, as in the CPU benchmark),
    per engine step, and per request in the gateway (start, validated, one message per token,
    finish). A real Scheduler is driven with fake tokens; only the hooks are timed."""
    from types import SimpleNamespace

    from llmserve.common import telemetry
    from llmserve.engine.contract.telemetry import EngineTelemetry
    from llmserve.gateway.telemetry import GatewayTelemetry
    from llmserve.protos import api_pb2
    from llmserve.protos.common_pb2 import SamplingParams
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.request import Request
    from llmserve.scheduler.scheduler import Scheduler
    from llmserve.scheduler.service.convert import plan_to_proto
    from llmserve.scheduler.service.telemetry import SchedulerTelemetry

    telemetry.setup("bench", metrics_port=free_port(), metrics_host="127.0.0.1")
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048), 4096, 16, 4096, 1000, (999,)
    )
    sched_tel, engine_tel = SchedulerTelemetry(), EngineTelemetry()
    for i in range(num_requests):
        request = Request(f"r{i}", i + 1, list(range(128)), SamplingParams(), num_tokens)
        scheduler.add(request)
        sched_tel.on_submit(request, ())
    timings = {"step_s": 0.2, "schedule_ms": 0.1, "step_rtt_ms": 200.0, "update_ms": 0.1}
    sched_s = engine_s = 0.0
    num_steps = 0
    while scheduler.has_work:
        plan = scheduler.schedule()
        t0 = time.perf_counter()
        sched_tel.on_plan(plan)
        t1 = time.perf_counter()
        msg = plan_to_proto(plan)
        t2 = time.perf_counter()
        engine_tel.on_step(msg, time.time_ns(), 200.0, 1.0, 202.0)
        t3 = time.perf_counter()
        outcomes = scheduler.update(plan, [7] * len(plan.requests), None)
        t4 = time.perf_counter()
        sched_tel.on_result(plan, outcomes, timings)
        for outcome in outcomes:
            if outcome.finished is not None:
                sched_tel.on_finish(outcome.request, outcome.finished)
        sched_s += (t1 - t0) + (time.perf_counter() - t4)
        engine_s += t3 - t2
        num_steps += 1
    gateway_tel = GatewayTelemetry()
    valid = SimpleNamespace(
        prompt_token_ids=list(range(128)),
        submit=SimpleNamespace(max_tokens=num_tokens),
    )
    message = api_pb2.GenerateResponse(token_ids=[7], text="x")
    last = api_pb2.GenerateResponse(token_ids=[7], text="x", finish_reason=2)
    t0 = time.perf_counter()
    for i in range(num_requests):
        trace = gateway_tel.start((), f"r{i}", "grpc")
        trace.validated(valid, None)  # type: ignore[arg-type]
        for _ in range(num_tokens - 1):
            trace.on_response(message)
        trace.on_response(last)
        trace.finish(last.finish_reason)
    gateway_s = time.perf_counter() - t0
    return {
        "num_steps": num_steps,
        "scheduler_us_per_step": 1e6 * sched_s / num_steps,
        "engine_us_per_step": 1e6 * engine_s / num_steps,
        "gateway_us_per_request": 1e6 * gateway_s / num_requests,
        "gateway_us_per_token": 1e6 * gateway_s / (num_requests * num_tokens),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "telemetry_overhead.json"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--skip-model", action="store_true")
    parser.add_argument(
        "--hooks-only", action="store_true", help="only time the hooks (quick; JSON to --out)"
    )
    args = parser.parse_args()
    receiver = OtlpReceiver().start()
    machine = hardware(torch_threads=True)
    if args.hooks_only:
        hooks = {"benchmark": "telemetry_hooks", "hardware": machine, "hooks": hook_costs()}
        save(hooks, args.out)
        print(json.dumps(hooks["hooks"], indent=2))
        return
    prompts, _ = exact_length_prompt_ids(builtin_model_path(), 16, 128)
    raw: dict[str, dict[str, list[float]]] = {"model": {}, "echo": {}}
    for r in range(args.rounds):
        for setting in SETTINGS:
            env = settings_env(setting, receiver)
            echo = bench_echo(env, num_streams=64, num_tokens=256)
            raw["echo"].setdefault(setting, []).append(echo)
            line = f"round {r} {setting:8s} echo {echo:9.1f} tok/s"
            if not args.skip_model:
                model = bench_stack(prompts, 128, 0, env)["output_tokens_per_s"]
                raw["model"].setdefault(setting, []).append(model)
                line += f"   model {model:6.2f} tok/s"
            print(line, flush=True)
    summary = {}
    for workload, by_setting in raw.items():
        if not by_setting:
            continue
        median = {s: statistics.median(v) for s, v in by_setting.items()}
        summary[workload] = {
            "tokens_per_s_median": median,
            "cost_vs_off_pct": {
                s: 100.0 * (1 - median[s] / median["off"]) for s in SETTINGS if s != "off"
            },
        }
    hooks = hook_costs()
    if "model" in summary:
        # The CPU benchmark's step: wall time / steps of bench/studies/cpu_stack.py's workload (one
        # 16 x 128-token prefill step, then 127 decode steps), from this run's `off` medians.
        step_s = 16 * 128 / summary["model"]["tokens_per_s_median"]["off"] / 128
        per_step_us = (
            hooks["scheduler_us_per_step"]
            + hooks["engine_us_per_step"]
            + hooks["gateway_us_per_token"] * 16
        )
        hooks["cpu_benchmark_step_ms"] = step_s * 1e3
        hooks["hooks_pct_of_cpu_benchmark_step"] = 100 * per_step_us / (step_s * 1e6)
    summary["hooks"] = hooks
    result = {
        "benchmark": "telemetry_overhead",
        "hardware": machine,
        "config": {"rounds": args.rounds, "settings": list(SETTINGS)},
        "raw_tokens_per_s": raw,
        "summary": summary,
        "spans_received": len(receiver.spans),
    }
    receiver.stop()
    save(result, args.out)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
