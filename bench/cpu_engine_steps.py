"""Issue 14's CPU step-by-step gains: one decode step of the built-in model, in-process (no
gRPC), at batch 1 / 16 / 64, for each change that went into the CPU engine:

    reference ops, worker thread   the forward on a thread other than the one that loaded the
                                   model (what the engine service did before: a gRPC worker)
    reference ops                  kernels/reference.py, on the loading thread
    cpu ops                        engine.ops.CpuOps (the engine's CPU default)
    cpu ops + int8                 --quantization int8 (kernels/cpu_int8.cpp)
    cpu ops + int8 + bf16 KV       --kv-cache-dtype bf16

    python -m bench.cpu_engine_steps [--out bench/results/cpu_engine_steps.json]

Each row: 128-token prompts prefilled, 3 warm-up decode steps, then the median of --steps timed
decode steps. Greedy tokens are recorded, so a row that computes something else shows.
"""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from engine.ops import ReferenceOps
from llmserve.bench.engine_driver import time_decode_steps
from llmserve.bench.report import hardware, save

ROOT = Path(__file__).resolve().parent.parent

MODES: list[tuple[str, dict[str, Any], bool, bool]] = [
    # (name, engine config fields, reference ops, forward on another thread)
    ("reference ops, worker thread", {"quantization": "none"}, True, True),
    ("reference ops", {"quantization": "none"}, True, False),
    ("cpu ops", {"quantization": "none"}, False, False),
    ("cpu ops + int8", {"quantization": "int8"}, False, False),
    ("cpu ops + int8 + bf16 KV", {"quantization": "int8", "kv_cache_dtype": "bf16"}, False, False),
]


def run_mode(
    fields: dict[str, Any], reference: bool, other_thread: bool, batches: list[int], steps: int
) -> list[dict[str, Any]]:
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=1200, seed=0, **fields))
    if reference:
        engine.model.set_ops(ReferenceOps())
    if not other_thread:
        return [time_decode_steps(engine, b, steps) for b in batches]
    rows: list[dict[str, Any]] = []
    worker = threading.Thread(
        target=lambda: rows.extend(time_decode_steps(engine, b, steps) for b in batches)
    )
    worker.start()
    worker.join()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_engine_steps.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for name, fields, reference, other_thread in MODES:
        rows = run_mode(fields, reference, other_thread, batches, args.steps)
        results.append({"mode": name, "config": fields, "rows": rows})
        print(name, " ".join(f"b{r['batch']}={r['step_ms_median']}ms" for r in rows), flush=True)
    base = {r["batch"]: r["step_ms_median"] for r in results[0]["rows"]}
    print(f"\n{'mode':32s}" + "".join(f"{f'batch {b} ms (x)':>22s}" for b in batches))
    for result in results:
        cells = "".join(
            f"{r['step_ms_median']:>13.1f} ({base[r['batch']] / r['step_ms_median']:4.2f}x)"
            for r in result["rows"]
        )
        print(f"{result['mode']:32s}{cells}")
    save(
        {"hardware": hardware(torch_threads=True), "steps": args.steps, "results": results},
        args.out,
    )
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
