"""The routing study: `llmserve serve --data-parallel-size 2 --device cpu` (the built-in
SmolLM2-135M-Instruct) under each routing policy, on one shared-prefix workload: prefix-cache hit
rate (summed over both replicas' schedulers), throughput and TTFT.

    python -m bench.studies.routing_study --output A.json --plot A.png
    python -m bench.studies.routing_study --plot-only --inputs A.json B.json --plot AB.png

The workload is `llmserve bench`'s prefix data set (num_prefixes shared prefixes of prefix_len
tokens, each request one of them + input_len tokens of its own) in a seeded random order (the
data set's own order is cyclic, which round-robin over 2 replicas would partition by accident),
sent at a Poisson request rate. Each replica's KV pool (--num-kv-blocks) holds about half the
prefixes: the regime where a prefix is cached decides whether it is hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.backends import GrpcBackend, SamplingConfig
from llmserve.bench.metrics import summarize
from llmserve.bench.options import requests_maker
from llmserve.bench.report import git_commit, hardware
from llmserve.bench.runner import run_benchmark, warm_up
from llmserve.bench.workload import WorkloadConfig
from llmserve.serve_flags import serve_locally
from llmserve.stats import stats_delta

POLICIES = ("round-robin", "least-load", "prefix")
COUNTERS = (
    "num_finished_requests",
    "num_prefix_cache_hit_tokens",
    "num_prefix_cache_query_tokens",
    "num_prompt_tokens",
    "num_scheduled_tokens",
    "num_preemptions",
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--request-rate", type=float, default=1.0)
    p.add_argument("--num-kv-blocks", type=int, default=64, help="per replica (16 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--output", type=Path, default=Path("routing_study.json"))
    p.add_argument("--plot", type=Path, default=Path("routing_study.png"))
    p.add_argument(
        "--plot-only", action="store_true", help="draw --plot from --inputs, one row each"
    )
    p.add_argument("--inputs", nargs="+", default=[], help="result JSONs for --plot-only")
    return p.parse_args()


def counter_deltas(before: list[Any], after: list[Any]) -> list[dict[str, int]]:
    """Each replica's COUNTERS accumulated between its two readings."""
    deltas = [stats_delta(b, a) for b, a in zip(before, after, strict=True)]
    return [{k: int(delta[k]) for k in COUNTERS} for delta in deltas]


async def measure(
    address: str, stack: Any, requests: list[Any], warmups: list[Any], args: argparse.Namespace
) -> dict[str, Any]:
    backend = GrpcBackend(address, SamplingConfig(temperature=0.0, ignore_eos=True))
    try:
        await warm_up(backend, warmups, 2)
        before = await asyncio.to_thread(stack.replica_stats)
        arrivals = ArrivalConfig(args.request_rate, 1.0, None, args.seed)
        records = await run_benchmark(backend, requests, arrivals)
        after = await asyncio.to_thread(stack.replica_stats)
    finally:
        await backend.close()
    replicas = counter_deltas(before, after)
    hits = sum(r["num_prefix_cache_hit_tokens"] for r in replicas)
    queried = sum(r["num_prefix_cache_query_tokens"] for r in replicas)
    metrics = summarize(records, None)
    return {
        "prefix_hit_rate": hits / queried if queried else 0.0,
        "replicas": replicas,
        "metrics": {k: v for k, v in metrics.items() if k not in ("itl_ms",)},
    }


def run_policy(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    serve_args = [
        "--data-parallel-size", "2", "--device", "cpu", "--routing", policy,
        "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "1024",
    ]  # fmt: skip
    workload = WorkloadConfig(
        dataset="prefix",
        num_requests=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        seed=args.seed,
    )
    requests_for = requests_maker(workload, None)
    requests = list(requests_for(0))
    random.Random(args.seed).shuffle(requests)
    with serve_locally(serve_args) as stack:
        result = asyncio.run(
            measure(stack.gateway_address, stack, requests, requests_for(-1), args)
        )
    print(
        f"{policy:12s} hit rate {result['prefix_hit_rate']:.3f}  "
        f"output {result['metrics']['output_throughput']:.1f} tok/s  "
        f"TTFT p50 {result['metrics']['ttft_ms']['p50']:.0f} ms  "
        f"per replica {[r['num_finished_requests'] for r in result['replicas']]}",
        flush=True,
    )
    return {"policy": policy, "serve_args": serve_args, **result}


def plot(documents: list[dict[str, Any]], path: Path) -> None:
    """One row of bars per document (a workload): hit rate, TTFT p50, output throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, rows = plt.subplots(len(documents), 3, figsize=(11, 3.1 * len(documents)), squeeze=False)
    for document, axes in zip(documents, rows, strict=True):
        runs = document["runs"]
        names = [r["policy"] for r in runs]
        panels = [
            ("prefix-cache hit rate", [r["prefix_hit_rate"] for r in runs], "{:.2f}"),
            ("TTFT p50 (ms)", [r["metrics"]["ttft_ms"]["p50"] for r in runs], "{:.0f}"),
            ("output tok/s", [r["metrics"]["output_throughput"] for r in runs], "{:.1f}"),
        ]
        w = document["config"]
        axes[0].set_ylabel(
            f"{w['num_prefixes']} prefixes x {w['prefix_len']} tok,\n"
            f"{w['num_kv_blocks']} KV blocks / replica",
            fontsize=9,
        )
        for ax, (title, values, fmt) in zip(axes, panels, strict=True):
            bars = ax.bar(names, values, color=["#999999", "#6a9fd8", "#2b6cb0"][: len(names)])
            ax.set_title(title, fontsize=10)
            for bar, value in zip(bars, values, strict=True):
                ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, value),
                            ha="center", va="bottom", fontsize=9)  # fmt: skip
            ax.tick_params(axis="x", labelsize=9)
    first = documents[0]
    fig.suptitle(
        f"2 replicas (serve --data-parallel-size 2 --device cpu), SmolLM2-135M, "
        f"{first['hardware'].get('logical_cores')}-core {first['hardware'].get('cpu')} VM; "
        f"Poisson {first['config']['request_rate']} req/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    args = parse_args()
    if args.plot_only:
        plot([json.loads(Path(p).read_text()) for p in args.inputs], args.plot)
        return 0
    runs = [run_policy(policy, args) for policy in args.policies]
    skip = ("output", "plot", "plot_only", "inputs")
    config = {k: v for k, v in vars(args).items() if k not in skip}
    document = {
        "kind": "routing_study",
        "git_commit": git_commit(),
        "hardware": hardware(),
        "config": config,
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    plot([document], args.plot)
    print(f"results: {args.output}\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
