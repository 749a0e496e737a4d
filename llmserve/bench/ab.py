"""`llmserve bench ab`: two server configurations measured in alternation, A then B, round after
round, each a fresh local stack (`llmserve serve` with that side's options on free loopback
ports) sent the same workload at once, as `bench offline` does. Alternating spreads whatever
else changes over the run (other load on the machine, clocks, caches) over both sides alike.

    llmserve bench ab --rounds 3 --a "--max-num-seqs 8" --b "--max-num-seqs 16" [workload options]

Prints each side's median over its rounds of the sweep table's figures and B against A;
saves every run (with its side, round and scheduler counters) in one result document.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import statistics
import sys
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.backends import BackendError, GrpcBackend, SamplingConfig
from llmserve.bench.workload import BenchRequest

SIDES = ("a", "b")


def add_ab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", required=True, help="side A's `llmserve serve` options, one string")
    p.add_argument("--b", required=True, help="side B's `llmserve serve` options, one string")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternating")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start")


def run_side(
    serve_args: list[str],
    requests: list[BenchRequest],
    sampling: SamplingConfig,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One run of one side: a fresh stack, the workload at once; its run entry."""
    from llmserve.bench.metrics import parse_goodput
    from llmserve.bench.report import run_entry
    from llmserve.bench.runner import measure_stack
    from llmserve.serve_flags import serve_locally

    arrivals = ArrivalConfig(math.inf, 1.0, None, args.seed)
    with serve_locally(serve_args, args.ready_timeout) as stack:
        backend = GrpcBackend(stack.gateway_address, sampling, args.save_detailed)
        measured = measure_stack(stack, backend, requests, arrivals, args.num_warmups)
        records, counters = asyncio.run(measured)
    entry = run_entry(arrivals, records, parse_goodput(args.goodput), args.save_detailed)
    entry["scheduler_stats"] = counters
    return entry


def side_medians(runs: list[dict[str, Any]], side: str) -> dict[str, float | None]:
    """side's median over its runs of each figure of the sweep table (report.SWEEP_COLUMNS;
    None where no run has it)."""
    from llmserve.bench.report import SWEEP_COLUMNS, sweep_value

    out: dict[str, float | None] = {}
    for label, key, stat in SWEEP_COLUMNS:
        values = [sweep_value(r["metrics"], key, stat) for r in runs if r["side"] == side]
        known = [float(v) for v in values if v is not None]
        out[label] = statistics.median(known) if known else None
    return out


def format_ab(runs: list[dict[str, Any]]) -> str:
    """The summary table: each side's medians and B / A."""
    a, b = side_medians(runs, "a"), side_medians(runs, "b")
    lines = [f"{'median over rounds':20s}{'A':>12s}{'B':>12s}{'B / A':>10s}"]
    for label in a:
        x, y = a[label], b[label]
        ratio = f"{y / x:10.3f}" if x and y is not None else f"{'-':>10s}"
        cells = "".join(f"{v:12.2f}" if v is not None else f"{'-':>12s}" for v in (x, y))
        lines.append(f"{label:20s}{cells}{ratio}")
    return "\n".join(lines)


def cmd_ab(args: argparse.Namespace) -> int:
    from llmserve.bench.metrics import parse_goodput
    from llmserve.bench.options import (
        common_config,
        requests_maker,
        result_path,
        sampling_config,
        workload_config,
    )
    from llmserve.bench.report import fmt, result_document, save
    from llmserve.serve_flags import parse_serve_flags
    from llmserve.stack import StackError

    sides = {"a": shlex.split(args.a), "b": shlex.split(args.b)}
    model = parse_serve_flags(sides["a"]).model
    parse_serve_flags(sides["b"])  # bad options end here, before anything starts
    try:
        if args.rounds < 1:
            raise ValueError(f"--rounds {args.rounds} must be >= 1")
        sampling = sampling_config(args)
        parse_goodput(args.goodput)
        requests = requests_maker(workload_config(args), args.tokenizer or model)(0)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    runs = []
    for i in range(args.rounds):
        for side in SIDES:
            try:
                entry = run_side(sides[side], requests, sampling, args)
            except (StackError, BackendError) as err:
                print(f"error: side {side.upper()}, round {i + 1}: {err}", file=sys.stderr)
                return 1
            runs.append({"side": side, "round": i, **entry})
            tok_s = fmt(entry["metrics"]["output_throughput"])
            print(f"round {i + 1} {side.upper()}: {tok_s} output tok/s", flush=True)
    print(format_ab(runs))
    config = {**common_config(args, requests), "rounds": args.rounds, "serve_args": sides}
    path = result_path(args, "ab")
    save(result_document("ab", config, {}, runs), path)
    print(f"results: {path}")
    return 0
