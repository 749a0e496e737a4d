"""Issue 6's study: static versus continuous batching on the same requests, as output lengths get
more varied, with HF transformers' `generate` (static batching) beside them.

    python -m bench.studies.static_vs_continuous            # about 10 minutes on 2 CPU cores
    python -m bench.studies.static_vs_continuous
        --quick    # 2-3 minutes: checks the script, no result

Workload: --num-requests prompts of exactly --prompt-tokens tokens (raw text, the built-in
SmolLM2-135M-Instruct's tokenizer), all sent at once, greedy, EOS ignored, output lengths from
four distributions of increasing variance and the same mean (--output-mean, at most
--output-max; see output_lengths): all equal; uniform within +-25%; log-normal (the long right
tail chat traffic has); uniform over [1, 2 * mean - 1]. The same prompts and lengths go to every
system:

continuous  `llmserve serve --max-num-seqs B --scheduling-policy continuous`: a finished request's
            slot is refilled at the next step.
static      the same stack with `--scheduling-policy static`: a batch of B is admitted only when
            nothing runs; finished members keep decoding throwaway tokens (padding) until the
            batch's longest member finishes (scheduler/scheduler.py says exactly how).
HF generate transformers' `generate` on the same token ids, batches of B in the same order, each
            generating its longest member's length (shorter members are padding), float32, run
            while the stack is stopped. It does not stream: its latency is each batch's end.

Both stacks run with prefix caching off (HF has none) and are warmed up first. Saves the raw
numbers (every request's lengths and timings) as JSON and the figure as PNG, prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.backends import GrpcBackend, SamplingConfig
from llmserve.bench.hf import load_model, timed_generate
from llmserve.bench.metrics import RequestRecord, summarize
from llmserve.bench.report import git_commit, hardware, record_json, save
from llmserve.bench.runner import run_benchmark, warm_up
from llmserve.bench.workload import BenchRequest, LogNormal, exact_length_prompt_ids
from llmserve.common.model_config import resolve_model_path
from llmserve.serve_flags import serve_locally
from llmserve.stats import stats_delta

ROOT = Path(__file__).resolve().parents[2]

POLICIES = ("continuous", "static")
SYSTEMS = (*POLICIES, "hf_generate")


# In order of increasing variance; all with mean --output-mean and at most --output-max.
LEVELS = ("fixed", "uniform-narrow", "lognormal", "uniform-wide")
LOGNORMAL_SIGMA = 0.8


def output_lengths(name: str, n: int, mean: int, most: int, rng: random.Random) -> list[int]:
    """n output lengths from the named distribution, each in [1, most]:

    fixed           all equal to mean                                     CV 0
    uniform-narrow  uniform within mean +- 25%                            CV 0.14
    lognormal       log-normal, sigma 0.8, redrawn above most, its mean   CV about 0.47
                    set so the capped mean is `mean` (with most = 2 mean)
    uniform-wide    uniform over [1, 2 mean - 1]                          CV 0.57
    """
    if name == "fixed":
        return [mean] * n
    if name == "uniform-narrow":
        return [rng.randint(max(1, round(mean * 0.75)), round(mean * 1.25)) for _ in range(n)]
    if name == "uniform-wide":
        return [rng.randint(1, min(2 * mean - 1, most)) for _ in range(n)]
    assert name == "lognormal", name
    dist = LogNormal(capped_lognormal_mean(mean, LOGNORMAL_SIGMA, most), LOGNORMAL_SIGMA)
    lengths: list[int] = []
    while len(lengths) < n:
        value = dist.sample(rng)
        if value <= most:  # redraw the tail beyond the cap rather than pile it up at the cap
            lengths.append(value)
    return lengths


def capped_lognormal_mean(target: float, sigma: float, cap: float) -> float:
    """The mean of a log-normal (with this sigma) whose mean below cap is target (bisection on
    E[X | X <= cap] = m * Phi((ln cap - mu - sigma^2) / sigma) / Phi((ln cap - mu) / sigma))."""

    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    def capped_mean(m: float) -> float:
        mu = math.log(m) - sigma**2 / 2
        z = (math.log(cap) - mu) / sigma
        return m * phi(z - sigma) / phi(z)

    low, high = target, 100 * target
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if capped_mean(mid) < target else (low, mid)
    return (low + high) / 2


def length_stats(lengths: list[int]) -> dict[str, float]:
    mean = statistics.fmean(lengths)
    std = statistics.pstdev(lengths)
    return {"mean": mean, "std": std, "cv": std / mean, "min": min(lengths), "max": max(lengths)}


# -- the stack ------------------------------------------------------------------------------------


def run_policy(
    policy: str, workloads: dict[str, list[BenchRequest]], args: argparse.Namespace
) -> dict[str, Any]:
    """One fresh stack with this policy; every level's requests at once, one level after another."""
    serve_args = ["--max-num-seqs", str(args.batch_size), "--scheduling-policy", policy]
    serve_args += ["--no-prefix-caching", "--kv-cache-gb", "1"]
    serve_args += ["--device", args.device, "--dtype", "float32"]
    if args.model:
        serve_args += ["--model", args.model]
    results: dict[str, Any] = {"serve_args": serve_args}
    with serve_locally(serve_args) as stack:
        backend = GrpcBackend(stack.gateway_address, SamplingConfig(), keep_token_ids=True)

        async def measure() -> None:
            await warm_up(backend, next(iter(workloads.values())), 1)
            for level, requests in workloads.items():
                before = stack.scheduler_stats()
                records = await run_benchmark(backend, requests, ArrivalConfig())
                results[level] = {
                    "metrics": summarize(records),
                    "scheduler_stats": stats_delta(before, stack.scheduler_stats()),
                    "requests": [record_json(r, detailed=True) for r in records],
                }
                print(f"  {policy} {level}: {describe(results[level]['metrics'])}", flush=True)
            await backend.close()

        asyncio.run(measure())
    return results


def describe(m: dict[str, Any]) -> str:
    return (
        f"{m['output_throughput']:.1f} out tok/s, E2E p50 {m['e2el_ms']['p50'] / 1e3:.2f} s, "
        f"{m['num_failed']} failed"
    )


# -- HF transformers generate ---------------------------------------------------------------------


def run_hf(
    model: Any, token_ids: list[list[int]], lengths: list[int], batch_size: int
) -> dict[str, Any]:
    """Static batches in request order; each generates its longest member's length. Not
    streamed: a request's tokens come at its batch's end, with no chunk times (no TTFT)."""
    records = [
        RequestRecord(i, len(ids), n, chunk_num_tokens=[n])
        for i, (ids, n) in enumerate(zip(token_ids, lengths, strict=True))
    ]
    start = time.perf_counter()
    num_computed = 0
    for first in range(0, len(records), batch_size):
        batch = records[first : first + batch_size]
        num_new = max(r.max_tokens for r in batch)
        timed_generate(model, token_ids[first : first + batch_size], num_new)
        end = time.perf_counter() - start
        for record in batch:
            record.latency_s = end
        num_computed += num_new * len(batch)
    return {
        "metrics": summarize(records),
        "num_computed_output_tokens": num_computed,
        "padding_fraction": 1 - sum(lengths) / num_computed,
    }


# -- report ---------------------------------------------------------------------------------------


def ratios(level: dict[str, Any]) -> dict[str, float | None]:
    def throughput(system: str) -> float | None:
        entry = level.get(system)
        return entry["metrics"]["output_throughput"] if entry else None

    cont, static, hf = throughput("continuous"), throughput("static"), throughput("hf_generate")
    return {
        "continuous_vs_static": cont / static if cont and static else None,
        "continuous_vs_hf_generate": cont / hf if cont and hf else None,
    }


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e3:.2f}"


def format_table(levels: list[dict[str, Any]]) -> str:
    header = (
        f"{'output lengths':<28}{'system':<13}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'E2E p50':>9}{'E2E p99':>9}{'steps':>7}"
    )
    lines = [header, "(latencies in seconds; steps: engine steps the stack ran)"]
    for level in levels:
        s = level["output_stats"]
        name = f"{level['name']} ({s['mean']:.0f}, CV {s['cv']:.2f})"
        for system in SYSTEMS:
            if system not in level:
                continue
            m = level[system]["metrics"]
            steps = level[system].get("scheduler_stats", {}).get("num_steps")
            lines.append(
                f"{name:<28}{system:<13}{m['output_throughput']:>10.1f}"
                f"{m['request_throughput']:>8.2f}{seconds(m['ttft_ms']['p50']):>10}"
                f"{seconds(m['ttft_ms']['p99']):>10}{seconds(m['e2el_ms']['p50']):>9}"
                f"{seconds(m['e2el_ms']['p99']):>9}{'-' if steps is None else f'{steps:.0f}':>7}"
            )
            name = ""
        r = level["ratios"]
        parts = [f"{k.replace('_vs_', ' / ')} {v:.2f}x" for k, v in r.items() if v is not None]
        lines.append(f"{'':<28}throughput: " + ", ".join(parts))
    return "\n".join(lines)


def plot(levels: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tp, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [f"{lv['name']}\nCV {lv['output_stats']['cv']:.2f}" for lv in levels]
    xs = list(range(len(levels)))
    labels = {"continuous": "continuous", "static": "static", "hf_generate": "HF generate"}
    for i, system in enumerate(SYSTEMS):
        if not all(system in lv for lv in levels):
            continue
        metrics = [lv[system]["metrics"] for lv in levels]
        color, label = f"C{i}", labels[system]
        ax_tp.plot(xs, [m["output_throughput"] for m in metrics], "o-", color=color, label=label)
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            values = [m["e2el_ms"][stat] / 1e3 for m in metrics]
            ax_lat.plot(xs, values, style, color=color, label=f"{label} {stat}")
    for ax, ylabel in ((ax_tp, "output tokens/s"), (ax_lat, "end-to-end latency (s)")):
        ax.set_xticks(xs, names)
        ax.set_ylabel(ylabel)
        ax.set_xlabel("output length distribution")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tp.set_ylim(bottom=0)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tiny configuration that checks the script"
    )
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where both the stack and HF generate run (float32 either way)",
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-mean", type=int, default=64)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="max_num_seqs; HF batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.num_requests, args.prompt_tokens, args.batch_size = 8, 16, 4
        args.output_mean, args.output_max = 8, 16
    # A quick run checks the script; its numbers mean nothing, so they stay out of the repo.
    results = Path(tempfile.gettempdir()) if args.quick else ROOT / "bench" / "results"
    name = "static_vs_continuous" + ("_quick" if args.quick else "")
    args.out = args.out or results / f"{name}.json"
    args.plot = args.plot or args.out.with_suffix(".png")
    return args


def build_levels(
    prompts: list[str], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, list[BenchRequest]]]:
    """Each level's output lengths (one seeded stream, levels in order) and its requests: the
    same prompts every time."""
    rng = random.Random(args.seed)
    levels: list[dict[str, Any]] = []
    workloads: dict[str, list[BenchRequest]] = {}
    for name in LEVELS:
        lengths = output_lengths(name, args.num_requests, args.output_mean, args.output_max, rng)
        levels.append(
            {"name": name, "output_lengths": lengths, "output_stats": length_stats(lengths)}
        )
        workloads[name] = [
            BenchRequest(args.prompt_tokens, n, text=p)
            for p, n in zip(prompts, lengths, strict=True)
        ]
    return levels, workloads


def run_hf_levels(
    levels: list[dict[str, Any]],
    model_path: Path,
    token_ids: list[list[int]],
    batch_size: int,
    device: str,
) -> None:
    print("HF transformers generate: loading the model", flush=True)
    model = load_model(model_path, device)
    timed_generate(model, token_ids[:1], 4)  # warm-up
    for level in levels:
        level["hf_generate"] = run_hf(model, token_ids, level["output_lengths"], batch_size)
        print(f"  hf_generate {level['name']}: {describe(level['hf_generate']['metrics'])}")


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    model_path = resolve_model_path(args.model)
    prompts, token_ids = exact_length_prompt_ids(
        model_path, args.num_requests, args.prompt_tokens, args.seed
    )
    levels, workloads = build_levels(prompts, args)
    for policy in POLICIES:
        print(f"{policy} batching: starting the stack", flush=True)
        results = run_policy(policy, workloads, args)
        for level in levels:
            level[policy] = {**results[level["name"]], "serve_args": results["serve_args"]}
    for level in levels:
        tokens = [[r["token_ids"] for r in level[p]["requests"]] for p in POLICIES]
        level["static_tokens_equal_continuous"] = tokens[0] == tokens[1]
    if not args.skip_hf:
        run_hf_levels(levels, model_path, token_ids, args.batch_size, args.device)
    for level in levels:
        level["ratios"] = ratios(level)
    document = {
        "benchmark": "static_vs_continuous",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "command": ["python", "-m", "bench.studies.static_vs_continuous", *sys.argv[1:]],
        "hardware": hardware(),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model": str(model_path),
        "wall_s": time.perf_counter() - started,
        "levels": levels,
    }
    save(document, args.out)
    title = (
        f"{model_path.name}: {args.num_requests} requests x {args.prompt_tokens} prompt tokens, "
        f"batch {args.batch_size}, {document['hardware']['cpu']}"
    )
    plot(levels, args.plot, title)
    print(format_table(levels))
    same = [lv["static_tokens_equal_continuous"] for lv in levels]
    print(f"static tokens == continuous tokens, per level: {same}")
    print(f"raw JSON: {args.out}\nplot: {args.plot}\nwall time: {document['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
