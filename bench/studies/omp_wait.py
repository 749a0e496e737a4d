"""Issue 30: how the CPU engine's OpenMP threads should wait between parallel regions, measured.

    python -m bench.studies.omp_wait [--rounds 3] [--steps 40] [--batches 1,16]
        [--settings "passive,spin 1k then sleep"] [--out bench/results/omp_wait.json]

libgomp reads its wait settings once, when torch loads it, so each setting runs in a process of
its own (the settings take turns, A B C A B C ..., so a machine whose load drifts slows them
alike). Each process builds the built-in model's engine (its defaults: gguf on this CPU, every
core) and decodes --steps tokens per request after a 3-step warm-up; after each step a second
process does a fixed piece of Python work (about what the scheduler plans and the gateway
detokenizes per step) and answers, and only then does the next step start, as in the stack:

    |<- engine step ->|<- the other process's work ->|<- engine step ->| ...
    |<------------- one token interval ------------->|

Per setting: the engine step (median ms), the token interval (median ms: what a client sees as
ITL), the engine process's CPU time per step (all its threads; spinning threads count) and the
other process's work time (median ms: stretched where spinning threads hold the cores it needs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# (name, environment set for the engine process; None: removed)
SETTINGS: list[tuple[str, dict[str, str | None]]] = [
    ("spin (libgomp's default)", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "300000"}),
    ("passive", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
    ("spin 10k then sleep", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "10000"}),
    ("spin 1k then sleep", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "1000"}),
    ("spin 3k then sleep", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "3000"}),
]

OTHER_WORK = "sum(i * i for i in range(20000))"  # about 1-3 ms of one core


def other_process() -> None:
    """The stand-in for the scheduler and gateway: one piece of work per byte read, a byte back."""
    while sys.stdin.buffer.read(1):
        eval(OTHER_WORK)
        sys.stdout.buffer.write(b".")
        sys.stdout.buffer.flush()


def child(batch: int, steps: int) -> dict[str, Any]:
    """One setting's run in this process (its environment already set)."""
    from llmserve.engine.step.cpu_threads import configure_openmp

    configure_openmp()  # as the engine service does, before torch loads: a no-op here, where
    # each setting names its own
    import torch

    from llmserve.bench.engine_driver import Driver
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=64 + 4 * batch, seed=0))
    other = subprocess.Popen(
        [sys.executable, "-m", "bench.studies.omp_wait", "--other"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    assert other.stdin is not None and other.stdout is not None
    driver = Driver(engine)
    driver.start([[100 + i] * 31 + [5] for i in range(batch)])
    for _ in range(3):
        driver.decode()
    step_ms, interval_ms, other_ms = [], [], []
    cpu0 = time.process_time()
    for _ in range(steps):
        t0 = time.perf_counter()
        driver.decode()
        t1 = time.perf_counter()
        other.stdin.write(b".")
        other.stdin.flush()
        other.stdout.read(1)
        t2 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        other_ms.append((t2 - t1) * 1e3)
        interval_ms.append((t2 - t0) * 1e3)
    cpu_ms = (time.process_time() - cpu0) * 1e3 / steps
    other.stdin.close()
    other.wait()
    return {
        "batch": batch,
        "threads": torch.get_num_threads(),
        "quantization": engine.quantization,
        "step_ms_median": round(statistics.median(step_ms), 2),
        "interval_ms_median": round(statistics.median(interval_ms), 2),
        "engine_cpu_ms_per_step": round(cpu_ms, 2),
        "other_ms_median": round(statistics.median(other_ms), 2),
        "first_tokens": driver.generated[0][:8],
    }


def run_setting(env_changes: dict[str, str | None], batch: int, steps: int) -> dict[str, Any]:
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    done = subprocess.run(
        [sys.executable, "-m", "bench.studies.omp_wait", "--child", str(batch), str(steps)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    # the 1-minute load average as the setting's run ended (this run's own 2-3 threads in it)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "loadavg_1m": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batches", default="1,16")
    p.add_argument(
        "--settings",
        default=",".join(name for name, _ in SETTINGS),
        help="which SETTINGS to run, by name, comma-separated",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "omp_wait.json")
    p.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--other", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.other:
        return other_process()
    if args.child:
        print(json.dumps(child(*args.child)))
        return None
    from llmserve.bench.report import hardware, save

    batches = [int(b) for b in args.batches.split(",")]
    chosen = args.settings.split(",")
    settings = [(name, env) for name, env in SETTINGS if name in chosen]
    if len(settings) != len(chosen):
        p.error(f"--settings {args.settings!r}: choose from {[n for n, _ in SETTINGS]}")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in settings}
    for r in range(args.rounds):
        for batch in batches:
            for name, env in settings:
                row = run_setting(env, batch, args.steps)
                runs[name].append(row)
                print(f"round {r} batch {batch} {name}: {row}", flush=True)
    keys = ("step_ms_median", "interval_ms_median", "engine_cpu_ms_per_step", "other_ms_median")
    summary = {
        name: {
            str(batch): {
                key: round(statistics.median(row[key] for row in rows if row["batch"] == batch), 2)
                for key in keys
            }
            for batch in batches
        }
        for name, rows in runs.items()
    }
    print(json.dumps(summary, indent=1))
    load = os.getloadavg()
    save(
        {
            "hardware": hardware(),
            "load_average_at_end": load,
            "settings": dict(settings),
            "other_work": OTHER_WORK,
            "steps": args.steps,
            "rounds": args.rounds,
            "summary": summary,
            "runs": runs,
        },
        args.out,
    )
    print(f"raw JSON: {args.out}")
    return None


if __name__ == "__main__":
    main()
