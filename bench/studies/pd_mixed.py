"""Prefill / decode disaggregation under a mixed load: `llmserve serve --device cpu` (the built-in
SmolLM2-135M-Instruct) colocated (one engine, every core) against `--prefill-engines 1
--decode-engines 1` (two engines, half the cores each), the same load on each: short chats
decoding while a stream of long prompts arrives. Measures the short chats' inter-token latency
and time to first token, the long prompts' time to first token, and tokens generated per second.

    python -m bench.studies.pd_mixed --output bench/results/pd_mixed.json

--num-chats clients each send short prompts (about 30 tokens) back to back, --chat-tokens
tokens each; one more client, from --long-delay seconds on, sends a long prompt (about
--long-len tokens, its words random so no two share a cached block) every --long-interval
seconds (or as soon as the previous one is done), --long-tokens tokens each. Every
request is greedy with ignore_eos. A run lasts --duration seconds of load (requests still open
then are waited for and counted). The configurations alternate, run after run (--repeats), in
one process, so the machine's load falls on both alike.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from llmserve.bench.report import git_commit, hardware
from llmserve.client import Client, make_request
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.serve_flags import serve_locally

WORDS = [
    "river", "stone", "cloud", "garden", "market", "lantern", "harbor", "violin", "pepper",
    "candle", "meadow", "orbit", "copper", "winter", "signal", "planet", "thunder", "pocket",
]  # fmt: skip
CHAT_TOPICS = ["rivers", "bread", "clocks", "bridges", "owls", "tea", "kites", "maps", "salt"]
# colocated-1t: one engine on one thread, as each of 1p1d's two engines runs (on this 2-core
# VM, shared with other jobs, an engine of two OpenMP threads spins in barriers whenever the
# other jobs hold a core: colocated-2t shows what that costs).
CONFIGS = {
    "colocated-1t": ["--num-threads", "1"],
    "colocated-2t": [],
    "1p1d": ["--prefill-engines", "1", "--decode-engines", "1"],
}


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The load's flags (and --repeats, --output), shared with bench/studies/pd_gpu_model.py."""
    p.add_argument("--num-chats", type=int, default=3)
    p.add_argument("--chat-tokens", type=int, default=24)
    p.add_argument("--long-len", type=int, default=600, help="words in a long prompt")
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--long-interval", type=float, default=8.0)
    p.add_argument(
        "--long-delay", type=float, default=5.0, help="seconds before the first long prompt"
    )
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--repeats", type=int, default=1)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--output", type=Path, default=Path("bench/results/pd_mixed.json"))
    p.add_argument(
        "--plot",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="run nothing: plot these result files (a round each) into bench/results/pd_mixed.png",
    )
    return p.parse_args()


def timed_request(client: Client, text: str, max_tokens: int, kind: str) -> dict[str, Any]:
    """One streamed request: its TTFT and the gap before each later token (a message holding
    several tokens counts its gap once per token, split evenly)."""
    request = make_request(text, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    prompt_tokens = 0
    for msg in client.stream(request, timeout=600):
        if msg.token_ids:
            arrivals.append((time.perf_counter(), len(msg.token_ids)))
        prompt_tokens = msg.usage.prompt_tokens or prompt_tokens
    gaps = []
    for (t_prev, _), (t, n) in itertools.pairwise(arrivals):
        gaps += [(t - t_prev) / n * 1e3] * n
    return {
        "kind": kind,
        "start_s": t0,
        "ttft_ms": (arrivals[0][0] - t0) * 1e3 if arrivals else None,
        "itl_ms": gaps,
        "num_tokens": sum(n for _, n in arrivals),
        "prompt_tokens": prompt_tokens,
    }


def run_load(address: str, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    lock = threading.Lock()
    end = time.perf_counter() + args.duration

    def chats(i: int) -> None:
        with Client(address) as client:
            k = 0
            while time.perf_counter() < end:
                topic = CHAT_TOPICS[(i + k) % len(CHAT_TOPICS)]
                text = f"Chat {i}, turn {k}. Tell me one short, true fact about {topic}, please."
                row = timed_request(client, text, args.chat_tokens, "chat")
                with lock:
                    rows.append(row)
                k += 1

    def long_prompts() -> None:
        rng = random.Random(seed)
        time.sleep(args.long_delay)  # the chats decode by then: the long prompts interrupt them
        with Client(address) as client:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                words = " ".join(rng.choice(WORDS) for _ in range(args.long_len))
                row = timed_request(client, f"Summarize: {words}", args.long_tokens, "long")
                with lock:
                    rows.append(row)
                time.sleep(max(0.0, args.long_interval - (time.perf_counter() - t0)))

    threads = [threading.Thread(target=chats, args=(i,)) for i in range(args.num_chats)]
    threads.append(threading.Thread(target=long_prompts))
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t_start
    for row in rows:
        row["start_s"] -= t_start
    rows.append({"kind": "elapsed", "seconds": elapsed})
    return rows


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    elapsed = next(r["seconds"] for r in rows if r["kind"] == "elapsed")
    chats = [r for r in rows if r["kind"] == "chat"]
    longs = [r for r in rows if r["kind"] == "long"]
    itl = [g for r in chats for g in r["itl_ms"]]
    chat_ttft = [r["ttft_ms"] for r in chats if r["ttft_ms"] is not None]
    long_ttft = [r["ttft_ms"] for r in longs if r["ttft_ms"] is not None]
    tokens = sum(r["num_tokens"] for r in chats + longs)
    return {
        "num_chats_done": len(chats),
        "num_long_done": len(longs),
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "chat_itl_ms_p50": pct(itl, 0.5),
        "chat_itl_ms_p99": pct(itl, 0.99),
        "chat_itl_ms_mean": statistics.mean(itl) if itl else None,
        "chat_ttft_ms_p50": pct(chat_ttft, 0.5),
        "chat_ttft_ms_p99": pct(chat_ttft, 0.99),
        "long_ttft_ms_p50": pct(long_ttft, 0.5),
        "long_ttft_ms_p99": pct(long_ttft, 0.99),
    }


def run_config(name: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    serve_args = ["--device", "cpu", "--max-model-len", "4096", *CONFIGS[name]]
    return run_stack(name, serve_args, args, seed)


def run_stack(
    name: str,
    serve_args: list[str],
    args: argparse.Namespace,
    seed: int,
    fake: EchoEngineConfig | None = None,
) -> dict[str, Any]:
    """The load on `llmserve serve serve_args` (fake: over echo engines): its summary, the
    transfers' counters and every request."""
    with serve_locally(serve_args, fake=fake) as stack:
        rows = run_load(stack.gateway_address, args, seed)
        stats = stack.scheduler_stats()
    transfers = {
        "num_kv_transfers_done": stats.num_kv_transfers_done,
        "num_kv_transfers_failed": dict(stats.num_kv_transfers_failed),
        "kv_transfer_bytes": stats.kv_transfer_bytes,
        "kv_transfer_s": stats.kv_transfer_s,
    }
    summary = summarize(rows)
    shown = {k: round(v, 1) for k, v in summary.items() if isinstance(v, float)}
    print(f"{name:10s} {shown} transfers {transfers}", flush=True)
    return {"config": name, "serve_args": serve_args, **summary, "transfers": transfers,
            "requests": rows}  # fmt: skip


def write_results(kind: str, args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """runs, with the commit, the machine and the flags, to args.output (JSON)."""
    document = {
        "kind": kind,
        "git_commit": git_commit(),
        "hardware": hardware(),
        "config": {k: v for k, v in vars(args).items() if k != "output"},
        "runs": runs,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"results: {args.output}")


def plot(paths: list[Path], out: Path) -> None:
    """Chat ITL and TTFT (p50, p99) and throughput per configuration, one group per round."""
    runs = [
        (f"{run['config']}\nround {r + 1}", run)
        for r, path in enumerate(paths)
        for run in json.loads(path.read_text())["runs"]
    ]  # fmt: skip
    plot_runs(
        runs, out, "output tok/s (both roles share 2 cores)",
        "short chats under a stream of long prompts: 1 prefill + 1 decode vs colocated",
    )  # fmt: skip


PANELS = [("chat ITL (ms, log)", "chat_itl_ms"), ("chat TTFT (ms, log)", "chat_ttft_ms")]


def plot_runs(
    runs: list[tuple[str, dict[str, Any]]],
    out: Path,
    throughput_title: str,
    title: str,
    panels: list[tuple[str, str]] = PANELS,
) -> None:
    """(label, run) side by side: a panel per (title, key) of panels (the run's key_p50 and
    key_p99, log scale), then throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _ in runs]
    num_cols = min(3, len(panels) + 1)
    num_rows = -(-(len(panels) + 1) // num_cols)
    panel_width = max(5.0, 0.6 * len(runs))
    fig, grid = plt.subplots(
        num_rows, num_cols, figsize=(panel_width * num_cols, 4.2 * num_rows), squeeze=False
    )
    axes = list(grid.flatten()[: len(panels) + 1])
    for unused in grid.flatten()[len(panels) + 1 :]:
        unused.set_visible(False)
    width = 0.38
    for ax, (panel, key) in zip(axes[:-1], panels, strict=True):
        for i, (_, run) in enumerate(runs):
            for j, q in enumerate(("p50", "p99")):
                x, v = i + (j - 0.5) * width, run[f"{key}_{q}"]
                ax.bar(x, v, width, color=f"C{j}", label=q if i == 0 else None)
                ax.annotate(f"{v:.0f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(panel)
        ax.legend()
    axes[-1].bar(range(len(runs)), [run["tokens_per_s"] for _, run in runs], color="C2")
    axes[-1].set_title(throughput_title)
    for ax in axes:
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> int:
    args = parse_args()
    if args.plot:
        plot(args.plot, Path("bench/results/pd_mixed.png"))
        return 0
    runs = []
    for repeat in range(args.repeats):
        for name in args.configs:
            runs.append(run_config(name, args, seed=repeat))
    write_results("pd_mixed", args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
