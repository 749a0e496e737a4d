"""Where a CPU decode step of the built-in model goes (issue 30's profile of the fused step): the
engine as `llmserve serve --device cpu` builds it (gguf blocks, the fused decode layers, passive
OpenMP waits), in-process, a batch of --batch requests of --prompt-len tokens prefilled, 3 warm-up
decode steps, then --steps decode steps under torch.profiler. Prints and saves each operator's
self CPU time per step (the top ones) and the share of the step they account for; what no
operator accounts for is Python around the step (plan to tensors, mirror, sampling's glue).

    python -m bench.studies.cpu_step_profile [--batch 1 16] [--threads 2] [--out JSON]
"""

# ruff: noqa: E402 (libgomp's wait policy is set before torch loads it)
from __future__ import annotations

from llmserve.engine.step.cpu_threads import configure_openmp

configure_openmp()  # as the engine service does, before torch loads libgomp

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.engine_driver import Driver
from llmserve.bench.report import hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[2]


def profile_batch(engine: Engine, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    driver = Driver(engine)
    driver.start([[(7 * i + 11 * b) % 4000 + 100 for i in range(prompt_len)] for b in range(batch)])
    for _ in range(3):
        driver.decode()
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            driver.decode()
            walls.append(time.perf_counter() - t0)
    step_ms = statistics.median(walls) * 1e3
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_ms = sum(walls) * 1e3
    top = [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "share_of_step": e.self_cpu_time_total / 1e3 / total_ms,
        }
        for e in rows[:20]
    ]
    ops_ms = sum(e.self_cpu_time_total for e in rows) / 1e3 / steps
    return {
        "batch": batch,
        "step_ms_median": step_ms,
        "step_ms_mean_profiled": total_ms / steps,
        "ops_self_ms_per_step": ops_ms,
        "calls_per_step": sum(e.count for e in rows) / steps,
        "top_ops": top,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="engine threads (0: the engine's rule)")
    p.add_argument("--out", type=Path, default=ROOT / "bench/results/cpu_step_profile.json")
    args = p.parse_args()
    config = EngineConfig(device="cpu", num_kv_blocks=1200, seed=0, num_threads=args.threads)
    engine = Engine(config)
    results = []
    for batch in args.batch:
        result = profile_batch(engine, batch, args.prompt_len, args.steps)
        results.append(result)
        step, ops = result["step_ms_median"], result["ops_self_ms_per_step"]
        calls = result["calls_per_step"]
        print(f"batch {batch}: step {step:.1f} ms (median), ops {ops:.1f} ms, {calls:.0f} calls")
        for row in result["top_ops"][:10]:
            ms, share, n = row["self_ms_per_step"], row["share_of_step"], row["calls_per_step"]
            print(f"  {ms:7.2f} ms  {share:6.1%}  {n:6.1f}x  {row['op']}")
    save(
        {
            "kind": "cpu_step_profile",
            "hardware": hardware(torch_threads=True),
            "quantization": engine.quantization,
            "config": vars(args) | {"out": None},
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
