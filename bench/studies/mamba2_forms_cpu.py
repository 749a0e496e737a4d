"""Issue 40's Mamba-2 measure on the CPU: a prefill chunk's selective state space by the
chunked (SSD) form against the token-by-token recurrence (engine/model/mamba2.py), both from
and to a carried state, and one decode token by the recurrence.

    python -m bench.studies.mamba2_forms_cpu [--out bench/results/mamba2_forms_cpu.json]
        [--reps 9] [--threads 1] [--tokens 64,256]

One float32 layer shape (H 32 heads x P 64 channels, G 1 group, N 128 state: an SSM state of
1 MiB per request and layer); the forms run alternately `--reps` times after a warm-up, their
medians compared within one run; each chunked output is checked against the recurrence's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.report import hardware, save
from llmserve.engine.model import mamba2

ROOT = Path(__file__).resolve().parents[2]
HEADS, HEAD_DIM, GROUPS, STATE = 32, 64, 1, 128


def inputs(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return {
        "x": torch.randn(n, HEADS, HEAD_DIM, generator=g),
        "dt": mamba2.discretize(torch.randn(n, HEADS, generator=g), torch.zeros(HEADS)),
        "a": -torch.rand(HEADS, generator=g) - 0.1,
        "b": torch.randn(n, GROUPS, STATE, generator=g),
        "c": torch.randn(n, GROUPS, STATE, generator=g),
        "d": torch.randn(HEADS, generator=g),
        "state": torch.randn(HEADS, HEAD_DIM, STATE, generator=g),
    }


def time_tokens(n: int, reps: int) -> dict[str, Any]:
    args = inputs(n)
    forms = {
        "recurrent": lambda: mamba2.recurrent(**args),
        "chunked_64": lambda: mamba2.chunked(**args, chunk=64),
        "chunked_256": lambda: mamba2.chunked(**args, chunk=256),
    }
    want = forms["recurrent"]()[0]
    for name, run in forms.items():
        got = run()[0]
        err = float((got - want).abs().max() / want.abs().max())
        assert err < 1e-4, (name, err)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(reps):
        for name, run in forms.items():
            start = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - start) * 1e3)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        "tokens": n,
        "median_ms": median,
        "speedup_vs_recurrent": {k: median["recurrent"] / v for k, v in median.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/mamba2_forms_cpu.json")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = [time_tokens(1, args.reps * 10)]
    for n in (int(t) for t in args.tokens.split(",")):
        results.append(time_tokens(n, args.reps))
    for row in results:
        cells = "  ".join(
            f"{k}: {m:.3f} ms ({row['speedup_vs_recurrent'][k]:.2f}x)"
            for k, m in row["median_ms"].items()
        )
        print(f"T={row['tokens']}: {cells}", flush=True)
    save(
        {
            "hardware": hardware(torch_threads=True),
            "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "groups": GROUPS, "state": STATE},
            "reps": args.reps,
            "load_average_1_5_15_before": load_before,
            "load_average_1_5_15_after": os.getloadavg(),
            "note": "the machine's 2 cores were shared with other sessions' work while this ran",
            "results": results,
        },
        args.out,
    )
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
