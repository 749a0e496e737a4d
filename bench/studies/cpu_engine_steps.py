"""Issue 14's CPU step-by-step gains: one decode step of the built-in model, in-process (no
gRPC), at batch 1 / 16 / 64, for each change that went into the CPU engine:

    reference ops, worker thread   the forward on a thread other than the one that loaded the
                                   model (what the engine service did before: a gRPC worker)
    reference ops                  kernels/reference.py, on the loading thread
    cpu ops                        engine.ops.CpuOps (the engine's CPU default)
    cpu ops + int8                 --quantization int8 (kernels/cpu_int8.cpp)
    cpu ops + int8 + bf16 KV       --kv-cache-dtype bf16
    cpu ops + gguf unfused         --quantization gguf (issue 30: the GGUF's 4-bit blocks as
                                   stored, kernels/cpu_gguf.cpp, activations int16 per block),
                                   each layer through its torch ops
    cpu ops + gguf                 the same with each decode layer one C++ call
                                   (engine/model/cpu_fused.py, the default)
    cpu ops + gguf + int8 act      the same with activations rounded to int8 (as llama.cpp)
    auto: gguf + dense copy        --quantization auto (issue 42): the blocks below the crossover
                                   measured at start, a oneDNN-packed dense copy from it on
                                   (engine/model/cpu_weights.py)

    python -m bench.studies.cpu_engine_steps [--out bench/results/cpu_engine_steps.json]
        [--modes "cpu ops + int8,cpu ops + gguf"] [--rounds 3]

Each row: prompts of --prompt-len tokens (128) prefilled, 3 warm-up decode steps, then the median
of --steps timed decode steps. Greedy tokens are recorded, so a row that computes something else
shows. With --rounds R the modes take turns R times (A B A B ...; each mode's engine built
once), so a machine whose load drifts slows them alike; a mode's figure is the median of its
rounds, and the ratios are to the first mode listed.
"""

# ruff: noqa: E402 (libgomp's wait policy is set before torch loads it)
from __future__ import annotations

from llmserve.engine.step.cpu_threads import configure_openmp

configure_openmp()  # as the engine service does, before torch loads libgomp

import argparse
import statistics
import threading
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.engine_driver import time_decode_steps
from llmserve.bench.report import hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.ops import ReferenceOps
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[2]

MODES: list[tuple[str, dict[str, Any], bool, bool]] = [
    # (name, engine config fields, reference ops, forward on another thread)
    ("reference ops, worker thread", {"quantization": "none"}, True, True),
    ("reference ops", {"quantization": "none"}, True, False),
    ("cpu ops", {"quantization": "none"}, False, False),
    ("cpu ops + int8", {"quantization": "int8"}, False, False),
    ("cpu ops + int8 + bf16 KV", {"quantization": "int8", "kv_cache_dtype": "bf16"}, False, False),
    ("cpu ops + gguf unfused", {"quantization": "gguf"}, False, False),
    ("cpu ops + gguf", {"quantization": "gguf"}, False, False),
    ("cpu ops + gguf + int8 act", {"quantization": "gguf"}, False, False),
    ("auto: gguf + dense copy", {"quantization": "auto"}, False, False),
]
ACT_BITS = {"cpu ops + gguf + int8 act": 8}  # kernels.cpu_gguf.ACT_BITS while the mode runs
UNFUSED = {"cpu ops + gguf unfused"}  # engine.cpu_fused.ENABLED off while the mode runs


def make_engine(fields: dict[str, Any], reference: bool, threads: int = 0) -> Engine:
    config = EngineConfig(device="cpu", num_kv_blocks=1200, seed=0, num_threads=threads, **fields)
    engine = Engine(config)
    if reference:
        engine.model.set_ops(ReferenceOps())
    return engine


def run_mode(
    name: str,
    engine: Engine,
    other_thread: bool,
    batches: list[int],
    steps: int,
    prompt_len: int,
) -> list[dict[str, Any]]:
    from llmserve.engine.model import cpu_fused
    from llmserve.kernels import cpu_gguf

    default_bits = cpu_gguf.ACT_BITS
    cpu_gguf.ACT_BITS = ACT_BITS.get(name, default_bits)
    cpu_fused.ENABLED = name not in UNFUSED
    try:
        if not other_thread:
            return [time_decode_steps(engine, b, steps, prompt_len) for b in batches]
        rows: list[dict[str, Any]] = []
        worker = threading.Thread(
            target=lambda: rows.extend(
                time_decode_steps(engine, b, steps, prompt_len) for b in batches
            )
        )
        worker.start()
        worker.join()
        return rows
    finally:
        cpu_gguf.ACT_BITS = default_bits
        cpu_fused.ENABLED = True


def run_rounds(
    modes: list[tuple[str, dict[str, Any], bool, bool]],
    batches: list[int],
    steps: int,
    rounds: int,
    prompt_len: int = 128,
    threads: int = 0,
) -> list[dict[str, Any]]:
    """Each mode's rows, the modes taking turns `rounds` times; a batch's figure is the median
    of its rounds' medians, every round's rows kept."""
    engines = {
        name: make_engine(fields, reference, threads) for name, fields, reference, _ in modes
    }
    per_round: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, *_ in modes}
    for r in range(rounds):
        for name, _, _, other_thread in modes:
            rows = run_mode(name, engines[name], other_thread, batches, steps, prompt_len)
            per_round[name].append(rows)
            cells = " ".join(f"b{row['batch']}={row['step_ms_median']}ms" for row in rows)
            print(f"round {r} {name}: {cells}", flush=True)
    results = []
    for name, fields, *_ in modes:
        rows = []
        for i, batch in enumerate(batches):
            medians = [round_rows[i]["step_ms_median"] for round_rows in per_round[name]]
            rows.append(
                {
                    "batch": batch,
                    "step_ms_median": round(statistics.median(medians), 2),
                    "round_medians": medians,
                    "tokens_per_s": round(batch * 1e3 / statistics.median(medians), 1),
                    "first_tokens": per_round[name][0][i]["first_tokens"],
                }
            )
        results.append({"mode": name, "config": fields, "rows": rows, "rounds": per_round[name]})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_engine_steps.json")
    p.add_argument("--modes", default="", help="comma-separated mode names (default: all)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: the engine's default, every usable core); 1 keeps a shared "
        "machine's descheduled OpenMP threads out of every parallel region's wait",
    )
    p.add_argument("--rounds", type=int, default=1, help="turns each mode takes (A B A B ...)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    wanted = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = [name for name, *_ in MODES]
    unknown = [m for m in wanted if m not in known]
    if unknown:
        p.error(f"--modes: unknown {unknown}; known: {known}")
    modes = sorted((m for m in MODES if m[0] in wanted), key=lambda m: wanted.index(m[0]))
    results = run_rounds(
        modes or MODES, batches, args.steps, args.rounds, args.prompt_len, args.threads
    )
    base = {r["batch"]: r["step_ms_median"] for r in results[0]["rows"]}
    print(f"\n{'mode':32s}" + "".join(f"{f'batch {b} ms (x)':>22s}" for b in batches))
    for result in results:
        cells = "".join(
            f"{r['step_ms_median']:>13.1f} ({base[r['batch']] / r['step_ms_median']:4.2f}x)"
            for r in result["rows"]
        )
        print(f"{result['mode']:32s}{cells}")
    save(
        {
            "hardware": hardware(torch_threads=True),
            "steps": args.steps,
            "rounds": args.rounds,
            "prompt_len": args.prompt_len,
            "threads": torch.get_num_threads(),
            "results": results,
        },
        args.out,
    )
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
