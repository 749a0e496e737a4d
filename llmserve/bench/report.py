"""The result document (JSON), the tables printed from it, and the latency-versus-throughput plot.

Every printed number is formatted from the document's own values, after it is built, so what is
printed is what is saved. The document holds the full configuration, the command line, the
llmserve version and commit, and the machine, so a run can be repeated and two runs compared.

    {"schema": "llmserve-bench/1", "kind": "serve" | "offline", "date", "llmserve_version",
     "git_commit", "command", "hardware", "server", "config",
     "runs": [{"label", "arrivals", "metrics", "requests": [...]}, ...]}

"hardware" is the machine the benchmark ran on: the client's, and for `offline` the server's too
(`serve` cannot see a remote server's; "server" holds what it says about itself).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import llmserve
from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.metrics import RequestRecord, summarize, tpot_s, ttft_s

SCHEMA = "llmserve-bench/1"
ROOT = Path(__file__).resolve().parents[2]

# (label, key) of the one-number metrics, in print order.
SCALARS = (
    ("completed requests", "num_completed"),
    ("failed requests", "num_failed"),
    ("duration (s)", "duration_s"),
    ("total input tokens", "total_input_tokens"),
    ("total output tokens", "total_output_tokens"),
    ("request throughput (req/s)", "request_throughput"),
    ("input token throughput (tok/s)", "input_throughput"),
    ("output token throughput (tok/s)", "output_throughput"),
    ("total token throughput (tok/s)", "total_token_throughput"),
    ("goodput (req/s)", "goodput"),
    ("max requests in flight", "max_in_flight"),
)
DISTRIBUTIONS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms"))
STATS = ("mean", "p50", "p90", "p99", "max")


# -- the document --------------------------------------------------------------------------------


def hardware(torch_threads: bool = False) -> dict[str, Any]:
    """This machine: CPU, cores, memory, GPUs (nvidia-smi), Python and torch versions. Read
    without importing torch, unless torch_threads asks for the threads torch computes with."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "gpus": _gpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    for package in ("torch", "grpcio"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if torch_threads:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    return info


def cpu_model() -> str:
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"


def _memory_gb() -> float | None:
    total = _proc_field("/proc/meminfo", "MemTotal")  # "16318412 kB"
    return round(int(total.split()[0]) / 2**20, 1) if total else None


def _proc_field(path: str, name: str) -> str | None:
    """The value of the first `name: value` line of a /proc file; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    out = _output("nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader") or ""
    return [line.strip() for line in out.splitlines() if line.strip()]


def git_commit() -> str | None:
    """The checkout's commit (with "-dirty" when files differ from it), or None outside one."""
    head = _output("git", "rev-parse", "HEAD")
    if head is None:
        return None
    dirty = _output("git", "status", "--porcelain", "--untracked-files=no") or ""
    return head.strip() + ("-dirty" if dirty.strip() else "")


def _output(*command: str) -> str | None:
    """command's stdout, run in the checkout; None when it cannot run, fails or takes over 10 s."""
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def record_json(record: RequestRecord, detailed: bool) -> dict[str, Any]:
    row: dict[str, Any] = {
        "index": record.index,
        "status": record.status,
        "error": record.error,
        "start_s": record.start_s,
        "latency_s": record.latency_s,
        "ttft_s": ttft_s(record),
        "tpot_s": tpot_s(record),
        "num_prompt_tokens": record.num_prompt_tokens,
        "max_tokens": record.max_tokens,
        "num_output_tokens": record.num_output_tokens,
        "output_tokens_from": record.output_tokens_from,
        "finish_reason": record.finish_reason,
    }
    if detailed:
        row["chunk_times_s"] = record.chunk_times_s
        row["chunk_num_tokens"] = record.chunk_num_tokens
        row["token_ids"] = record.token_ids
    return row


def run_entry(
    arrivals: ArrivalConfig,
    records: Sequence[RequestRecord],
    goodput_targets_ms: dict[str, float] | None,
    detailed: bool = False,
) -> dict[str, Any]:
    return {
        "label": arrivals.label,
        "arrivals": arrivals.to_json(),
        "metrics": summarize(records, goodput_targets_ms),
        "requests": [record_json(r, detailed) for r in records],
    }


def result_document(
    kind: str, config: dict[str, Any], server: dict[str, Any], runs: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "kind": kind,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "llmserve_version": llmserve.__version__,
        "git_commit": git_commit(),
        "command": ["llmserve", *sys.argv[1:]],
        # This machine: the client's, and for `offline` the server's too.
        "hardware": hardware(),
        "server": server,
        "config": config,
        "runs": runs,
    }


def save(document: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def load(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(Path(path).read_text())
    if document.get("schema") != SCHEMA:
        raise ValueError(
            f"{path}: not an llmserve bench result (schema {document.get('schema')!r})"
        )
    return document


# -- tables ---------------------------------------------------------------------------------------


def fmt(value: Any) -> str:
    """How every number is printed: floats with 2 decimals, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def format_run(run: dict[str, Any], goodput_targets_ms: dict[str, float] | None = None) -> str:
    """One run's metrics as a table."""
    m = run["metrics"]
    lines = [f"== {run['label']} =="]
    for label, key in SCALARS:
        if key == "goodput" and m[key] is None:
            continue
        lines.append(f"{label:<34}{fmt(m[key]):>12}")
    if goodput_targets_ms:
        targets = ", ".join(f"{k} <= {v:g} ms" for k, v in goodput_targets_ms.items())
        lines.append(f"  goodput targets: {targets}; {m['num_good_requests']} requests met them")
    if m["num_short_outputs"]:
        lines.append(f"  {m['num_short_outputs']} requests ended before max_tokens")
    lines.append(f"{'latency (ms)':<10}" + "".join(f"{s:>12}" for s in STATS))
    for label, key in DISTRIBUTIONS:
        lines.append(f"{label:<10}" + "".join(f"{fmt(m[key][s]):>12}" for s in STATS))
    errors = ", ".join(f"{code} {count}" for code, count in m["errors"].items())
    lines.append(f"errors by status: {errors or 'none'}")
    return "\n".join(lines)


SWEEP_COLUMNS = (
    ("req/s", "request_throughput", None),
    ("out tok/s", "output_throughput", None),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TTFT p99", "ttft_ms", "p99"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("TPOT p99", "tpot_ms", "p99"),
    ("ITL p99", "itl_ms", "p99"),
    ("E2E p50", "e2el_ms", "p50"),
    ("E2E p99", "e2el_ms", "p99"),
    ("goodput", "goodput", None),
    ("failed", "num_failed", None),
)


def sweep_value(metrics: dict[str, Any], key: str, stat: str | None) -> Any:
    return metrics[key] if stat is None else metrics[key][stat]


def format_sweep(runs: Sequence[dict[str, Any]]) -> str:
    """One line per run (latencies in ms)."""
    width = max(len(r["label"]) for r in runs)
    header = f"{'arrivals':<{width}}" + "".join(f"{name:>11}" for name, _, _ in SWEEP_COLUMNS)
    lines = [header]
    for run in runs:
        cells = [fmt(sweep_value(run["metrics"], k, s)) for _, k, s in SWEEP_COLUMNS]
        lines.append(f"{run['label']:<{width}}" + "".join(f"{c:>11}" for c in cells))
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------------


def plot_sweep(runs: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Latency (TTFT, TPOT, E2E; p50 and p99) against achieved request throughput, one point
    per run, labelled with its arrivals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    xs = [r["metrics"]["request_throughput"] or 0.0 for r in runs]
    for ax, (name, key) in zip(
        axes, (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2el_ms")), strict=True
    ):
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            ys = [r["metrics"][key][stat] for r in runs]
            points = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), style, label=f"{name} {stat}")
        for x, run in zip(xs, runs, strict=True):
            y = run["metrics"][key]["p50"]
            if y is not None:
                ax.annotate(
                    run["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
        ax.set_xlabel("achieved throughput (requests/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
