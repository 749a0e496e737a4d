"""`llmserve bench`: serve (against a running gateway), offline (a local stack's maximum
throughput), ab (two server configurations in alternation), compare (two result files).

llmserve bench serve [--backend grpc|openai] [--dataset-name fixed|random|sharegpt|prefix|jsonl]
                     [--num-prompts N] [--input-len N] [--output-len N] [--request-rate R[,R...]]
                     [--burstiness B] [--max-concurrency C[,C...]] [--goodput ttft:MS tpot:MS]
llmserve bench offline [workload options] -- [llmserve serve options]
llmserve bench ab --a "SERVE OPTIONS" --b "SERVE OPTIONS" [--rounds N] [workload options]
llmserve bench compare A.json B.json

A list of rates (or of concurrencies) is a sweep: one run each, a summary table and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig, rate_to_json
from llmserve.bench.backends import BACKENDS, BackendError, GrpcBackend
from llmserve.bench.metrics import parse_goodput
from llmserve.bench.options import (
    RequestsFor,
    arrival_configs,
    common_config,
    requests_maker,
    result_path,
    sampling_config,
    workload_config,
)
from llmserve.bench.workload import DATASETS
from llmserve.common.net import DEFAULT_GATEWAY_PORT

DEFAULT_ADDRESS = f"localhost:{DEFAULT_GATEWAY_PORT}"
DEFAULT_BASE_URL = "http://localhost:8000"


# -- arguments ------------------------------------------------------------------------------------


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (seeded: the same options give the same requests)")
    g.add_argument("--dataset-name", default="fixed", choices=DATASETS)
    g.add_argument("--num-prompts", type=int, default=100, help="requests in the workload")
    g.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        default=128,
        help="prompt tokens (fixed, random; prefix: tokens after the shared prefix)",
    )
    g.add_argument(
        "--output-len", "--random-output-len", type=int, default=128, help="output tokens"
    )
    g.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.5,
        help="random: lengths uniform in [len * (1 - r), len * (1 + r)]",
    )
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix: distinct shared prefixes")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix: tokens in each prefix")
    g.add_argument("--dataset-path", default=None, help="jsonl: the file of prompts")
    g.add_argument(
        "--chat", action="store_true", help="send each prompt as a user message (chat template)"
    )
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    g.add_argument(
        "--tokenizer",
        default=None,
        help="model directory or .gguf whose tokenizer measures prompts (default: the built-in "
        "model; for offline, the served model)",
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly each request's output length",
    )
    g.add_argument("--request-timeout", type=float, default=None, help="seconds per request")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("results")
    g.add_argument(
        "--output",
        type=Path,
        default=None,
        help="result JSON (default: llmserve-bench-KIND-DATE-TIME.json here)",
    )
    g.add_argument("--plot", type=Path, default=None, help="latency vs throughput PNG (sweeps)")
    g.add_argument(
        "--save-detailed",
        action="store_true",
        help="also save every request's chunk times and token ids",
    )
    g.add_argument("--label", default="", help="free text saved with the results")
    g.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="targets for goodput, e.g. ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    g.add_argument("--num-warmups", type=int, default=1, help="requests sent before measuring")
    g.add_argument("--no-progress", action="store_true", help="no live progress bar")


def _add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--backend", default="grpc", choices=BACKENDS)
    g.add_argument(
        "--address",
        default=os.environ.get("LLMSERVE_ADDRESS", DEFAULT_ADDRESS),
        help="grpc: the gateway",
    )
    g.add_argument("--base-url", default=DEFAULT_BASE_URL, help="openai: the HTTP server")
    g.add_argument(
        "--model", default=None, help="openai: the model field (default: from /v1/models)"
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (env LLMSERVE_API_KEY or OPENAI_API_KEY)",
    )


def _add_arrival_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("arrivals")
    g.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s, Poisson (or gamma, see --burstiness); inf sends all at once; "
        "a comma-separated list is a sweep",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier"
    )
    g.add_argument(
        "--max-concurrency",
        default=None,
        help="requests in flight at most; a comma-separated list is a sweep",
    )


def add_bench_parser(sub: Any) -> None:
    """Add `bench` and its subcommands to the `llmserve` parser's subparsers."""
    bench = sub.add_parser("bench", help="benchmark a gateway, the engine, or compare results")
    commands = bench.add_subparsers(dest="bench_command", required=True)

    p = commands.add_parser("serve", help="replay a workload against a running gateway")
    _add_target_args(p)
    _add_workload_args(p)
    _add_arrival_args(p)
    _add_output_args(p)
    p.set_defaults(func=cmd_serve)

    p = commands.add_parser(
        "offline",
        help="start a local stack, send every request at once: maximum throughput",
        description="Starts `llmserve serve` with the options after `--`, e.g. "
        "`llmserve bench offline --num-prompts 64 -- --max-num-seqs 16`.",
    )
    _add_workload_args(p)
    _add_output_args(p)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then llmserve serve options")
    p.set_defaults(func=cmd_offline)

    from llmserve.bench.ab import add_ab_args, cmd_ab

    p = commands.add_parser(
        "ab",
        help="two `llmserve serve` configurations measured in alternation, round after round",
        description="Starts a local stack with --a's options, sends the workload at once, stops "
        "it; the same with --b's; --rounds times. E.g. `llmserve bench ab --rounds 3 --num-prompts "
        '32 --a "--max-num-seqs 8" --b "--max-num-seqs 16"`.',
    )
    _add_workload_args(p)
    _add_output_args(p)
    add_ab_args(p)
    p.set_defaults(func=cmd_ab)

    from llmserve.bench.step import add_step_args, cmd_step

    p = commands.add_parser(
        "step",
        help="the engine's decode step in-process, for several configurations side by side",
        description="Arms: mode:NAME, family:NAME, lora:base / lora:SHAPExK, tp:MODELxT "
        "(llmserve/bench/step_arms.py). E.g. `llmserve bench step --arms mode:gguf mode:auto "
        "--batches 1,16,64`.",
    )
    add_step_args(p)
    p.set_defaults(func=cmd_step)

    p = commands.add_parser("compare", help="two result files side by side")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.set_defaults(func=cmd_compare)


def _bench(
    args: argparse.Namespace,
    kind: str,
    backend: Any,
    requests_for: RequestsFor,
    arrivals: list[ArrivalConfig],
    config: dict[str, Any],
    stack: Any = None,
    serve_args: list[str] | None = None,
) -> int:
    """Describe the server, warm up (variant -1), then run i sends variant i of the workload on
    arrivals[i], each run's table printed as it ends; save the result document (config: what
    this kind adds to the common settings) and return the exit code. stack: `offline`'s local
    stack (started with serve_args), whose scheduler counters over the measured run go with it
    and whose logs go with an error."""
    from llmserve.bench.report import format_run, result_document, run_entry
    from llmserve.bench.runner import run_benchmark, warm_up
    from llmserve.stats import stats_delta

    targets = parse_goodput(args.goodput)
    runs: list[dict[str, Any]] = []
    before: list[Any] = []  # offline: the scheduler's counters after the warm-up

    async def run_all() -> dict[str, Any]:
        try:
            server: dict[str, Any] = await backend.describe()
            await warm_up(backend, requests_for(-1), args.num_warmups)
            if stack:
                before.append(stack.scheduler_stats())
            for i, arrival in enumerate(arrivals):
                records = await run_benchmark(
                    backend, requests_for(i), arrival, not args.no_progress
                )
                runs.append(run_entry(arrival, records, targets, args.save_detailed))
                print(format_run(runs[-1], targets), flush=True)
        finally:
            await backend.close()
        return server

    try:
        server = asyncio.run(run_all())
    except BackendError as err:
        logs = f"\n{stack.logs()}" if stack else ""
        print(f"error: {err}{logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing saved", file=sys.stderr)
        return 130
    if stack:
        runs[0]["scheduler_stats"] = stats_delta(before[0], stack.scheduler_stats())
        runs[0]["speculative_decoding"] = spec_summary(runs[0]["scheduler_stats"])
        _print_scheduler_stats(runs[0]["scheduler_stats"])
        server.pop("address")  # a free loopback port, different every time
        server["serve_args"] = serve_args
    config = {**common_config(args, requests_for(0)), **config}
    _finish(result_document(kind, config, server, runs), args, kind)
    return 0


def _finish(document: dict[str, Any], args: argparse.Namespace, kind: str) -> None:
    from llmserve.bench.report import format_sweep, plot_sweep, save

    runs = document["runs"]
    if len(runs) > 1:
        print(format_sweep(runs))
    path = result_path(args, kind)
    save(document, path)
    print(f"results: {path}")
    if len(runs) > 1 or args.plot:
        plot = args.plot or path.with_suffix(".png")
        try:
            plot_sweep(runs, plot, f"llmserve bench {kind}: {document['server'].get('model', '')}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install 'llmserve[bench]')")
            return
        print(f"plot: {plot}")


# -- commands -------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.bench.backends import OpenAIBackend

    try:
        arrivals = arrival_configs(args)
        parse_goodput(args.goodput)
        sampling = sampling_config(args)
        requests_for = requests_maker(workload_config(args), args.tokenizer)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    backend = (
        GrpcBackend(args.address, sampling, args.save_detailed, args.api_key)
        if args.backend == "grpc"
        else OpenAIBackend(args.base_url, sampling, args.model, args.api_key)
    )
    config = {
        "backend": args.backend,
        "target": args.address if args.backend == "grpc" else args.base_url,
        "sweep": [
            {"request_rate": rate_to_json(a.request_rate), "max_concurrency": a.max_concurrency}
            for a in arrivals
        ],
    }
    return _bench(args, "serve", backend, requests_for, arrivals, config)


def cmd_offline(args: argparse.Namespace) -> int:
    from llmserve.serve_flags import parse_serve_flags, serve_locally
    from llmserve.stack import StackError

    serve_args = [a for a in args.serve_args if a != "--"] if args.serve_args else []
    model = parse_serve_flags(serve_args).model
    try:
        sampling = sampling_config(args)
        parse_goodput(args.goodput)
        requests_for = requests_maker(workload_config(args), args.tokenizer or model)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    arrivals = [ArrivalConfig(math.inf, 1.0, None, args.seed)]
    try:
        with serve_locally(serve_args, args.ready_timeout) as stack:
            backend = GrpcBackend(stack.gateway_address, sampling, args.save_detailed)
            return _bench(args, "offline", backend, requests_for, arrivals, {}, stack, serve_args)
    except StackError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def _print_scheduler_stats(stats: dict[str, Any]) -> None:
    """The scheduler's view of the measured run (and its speculative decoding's, if any)."""
    steps = stats.get("num_steps", 0.0)
    tokens = stats.get("num_scheduled_tokens", 0.0)
    per_step = tokens / steps if steps else 0.0
    print(
        f"scheduler: {steps:.0f} steps, {tokens:.0f} tokens scheduled ({per_step:.2f} per step), "
        f"{stats.get('num_preemptions', 0.0):.0f} preemptions"
    )
    spec = spec_summary(stats)
    if spec:
        per_pos = ", ".join(f"{rate:.2f}" for rate in spec["acceptance_per_position"])
        print(
            f"speculative decoding: {spec['verifications']:.0f} verifications, acceptance rate "
            f"{spec['acceptance_rate']:.3f}, mean accepted length "
            f"{spec['mean_accepted_length']:.2f} tokens, acceptance by position: {per_pos}"
        )


def spec_summary(stats: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding's figures from the scheduler's counters ({} when nothing was
    proposed): verifications, acceptance rate (accepted / proposed), mean accepted length
    (tokens per verification: accepted + 1) and acceptance per proposal position."""
    rows = stats.get("num_spec_rows", 0.0)
    draft = stats.get("num_spec_draft_tokens", 0.0)
    if not rows or not draft:
        return {}
    accepted = stats.get("num_spec_accepted_tokens", 0.0)
    per_pos = zip(
        stats.get("num_spec_accepted_tokens_per_pos", []),
        stats.get("num_spec_draft_tokens_per_pos", []),
        strict=False,
    )
    return {
        "verifications": rows,
        "acceptance_rate": accepted / draft,
        "mean_accepted_length": 1.0 + accepted / rows,
        "acceptance_per_position": [a / d if d else 0.0 for a, d in per_pos],
    }


def cmd_compare(args: argparse.Namespace) -> int:
    from llmserve.bench.compare import compare
    from llmserve.bench.report import load

    try:
        a, b = load(args.a), load(args.b)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(compare(a, b, str(args.a), str(args.b)))
    return 0
