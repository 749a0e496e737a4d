"""Issue 2's CPU benchmark: 16 concurrent streams through the whole stack vs HF transformers.

    python -m bench.studies.cpu_stack [--out bench/results/cpu_stack.json]

Workload: 16 prompts of exactly 128 tokens (raw text, no template), 128 output tokens each,
greedy, EOS ignored, sent at once to a freshly started `llmserve serve` on the built-in
SmolLM2-135M-Instruct. Reports aggregate output tokens/s, p50/p99 time to first token and
inter-token latency (gap between streamed chunks), and where each step's time goes. Then HF
transformers `generate` on the same token ids, float32, at batch 1 and batch 16 (static batch),
run while the stack is stopped so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from pathlib import Path

from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.backends import GrpcBackend, SamplingConfig
from llmserve.bench.hf import load_model, timed_generate
from llmserve.bench.metrics import summarize
from llmserve.bench.report import hardware, save
from llmserve.bench.runner import measure_stack
from llmserve.bench.workload import BenchRequest, exact_length_prompt_ids
from llmserve.common.model_config import builtin_model_path
from llmserve.serve_flags import serve_locally

ROOT = Path(__file__).resolve().parents[2]


def bench_stack(
    prompts: list[str],
    max_tokens: int,
    threads: int,
    env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> dict:
    """env: extra environment for the services (bench/studies/telemetry_overhead.py sets OTEL_*);
    metrics are on (each service's /metrics), as in a default `llmserve serve`, unless env sets
    LLMSERVE_METRICS_PORT=0. extra_args: more `llmserve serve` flags (e.g.
    engine groups)."""
    serve_args = ["--kv-cache-gb", "1"] + (["--num-threads", str(threads)] if threads else [])
    serve_args += extra_args or []
    requests = [BenchRequest(0, max_tokens, text=p) for p in prompts]  # prompt lengths unused
    metrics = (env or {}).get("LLMSERVE_METRICS_PORT") != "0"
    with serve_locally(serve_args, 300, env=env, metrics=metrics) as stack:
        backend = GrpcBackend(stack.gateway_address, SamplingConfig(0.0, ignore_eos=True))
        # One request of at most 16 tokens to warm up, then every prompt at once.
        measured = measure_stack(stack, backend, requests, ArrivalConfig(math.inf), 1)
        records, delta = asyncio.run(measured)
    failed = [f"{r.status}: {r.error}" for r in records if not r.ok]
    assert not failed, failed
    t_start = min(r.start_s for r in records)
    t_end = max(r.start_s + r.chunk_times_s[-1] for r in records)
    num_tokens = sum(r.num_output_tokens for r in records)
    assert num_tokens == len(prompts) * max_tokens, num_tokens
    latencies = summarize(records)
    ttft, itl = latencies["ttft_ms"], latencies["itl_ms"]
    steps = max(delta["num_steps"], 1.0)
    per_step = {
        "schedule_ms": delta["schedule_ms"] / steps,
        "grpc_hop_ms": (delta["step_rtt_ms"] - delta["engine_total_ms"]) / steps,
        "engine_forward_ms": delta["engine_forward_ms"] / steps,
        "engine_sample_ms": delta["engine_sample_ms"] / steps,
        "engine_other_ms": (
            delta["engine_total_ms"] - delta["engine_forward_ms"] - delta["engine_sample_ms"]
        )
        / steps,
        "update_and_stream_ms": delta["update_ms"] / steps,
    }
    wall = t_end - t_start
    return {
        "output_tokens": num_tokens,
        "wall_s": wall,
        "output_tokens_per_s": num_tokens / wall,
        "ttft_ms": {"p50": ttft["p50"], "p99": ttft["p99"]},
        "itl_ms": {"p50": itl["p50"], "p99": itl["p99"]},
        "num_steps": delta["num_steps"],
        "step_ms": wall * 1e3 / steps,
        "per_step": per_step,
    }


def bench_hf(token_ids: list[list[int]], max_tokens: int, batch_1_requests: int) -> dict:
    model = load_model(builtin_model_path())
    timed_generate(model, token_ids[:1], max_tokens)  # warm-up
    times_1 = [timed_generate(model, [ids], max_tokens) for ids in token_ids[:batch_1_requests]]
    time_16 = timed_generate(model, token_ids, max_tokens)
    return {
        "batch_1": {
            "requests": batch_1_requests,
            "output_tokens_per_s": max_tokens / statistics.median(times_1),
            "seconds_per_request": times_1,
        },
        "batch_16": {
            "output_tokens_per_s": len(token_ids) * max_tokens / time_16,
            "seconds": time_16,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_stack.json")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch-1-requests", type=int, default=4)
    parser.add_argument("--engine-threads", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()

    prompts, token_ids = exact_length_prompt_ids(
        builtin_model_path(), args.streams, args.prompt_tokens
    )
    stack = bench_stack(prompts, args.output_tokens, args.engine_threads)
    hf = None if args.skip_hf else bench_hf(token_ids, args.output_tokens, args.hf_batch_1_requests)
    result = {
        "benchmark": "cpu_stack",
        "date": time.strftime("%Y-%m-%d"),
        "hardware": hardware(torch_threads=True),
        "workload": {
            "streams": args.streams,
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "greedy": True,
            "ignore_eos": True,
            "model": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to float32)",
        },
        "llmserve": stack,
        "hf_transformers": hf,
    }
    if hf:
        result["ratios"] = {
            "vs_hf_batch_1": stack["output_tokens_per_s"] / hf["batch_1"]["output_tokens_per_s"],
            "vs_hf_batch_16": stack["output_tokens_per_s"] / hf["batch_16"]["output_tokens_per_s"],
        }
    save(result, args.out)

    s = stack
    print(f"hardware: {result['hardware']['cpu']}, {result['hardware']['logical_cores']} cores")
    print(
        f"llmserve, {args.streams} streams: {s['output_tokens_per_s']:.1f} output tok/s, "
        f"TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, "
        f"ITL p50/p99 {s['itl_ms']['p50']:.1f}/{s['itl_ms']['p99']:.1f} ms"
    )
    print(
        "per step (ms): "
        + ", ".join(f"{k} {v:.2f}" for k, v in s["per_step"].items())
        + f"; wall {s['step_ms']:.2f}"
    )
    if hf:
        print(
            f"HF generate: batch 1 {hf['batch_1']['output_tokens_per_s']:.1f} tok/s, "
            f"batch 16 {hf['batch_16']['output_tokens_per_s']:.1f} tok/s"
        )
        r = result["ratios"]
        print(
            f"ratio: {r['vs_hf_batch_1']:.2f}x HF batch 1 (goal >= 3), "
            f"{r['vs_hf_batch_16']:.2f}x HF batch 16 (goal >= 0.8)"
        )
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
