"""Two result documents side by side: what differs in how they were run, then each pair of runs
(matched in order) metric by metric, with the relative change from A to B."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llmserve.bench.report import fmt, sweep_value

# (label, metric key, statistic or None, True when higher is better)
COMPARED = (
    ("request throughput (req/s)", "request_throughput", None, True),
    ("output throughput (tok/s)", "output_throughput", None, True),
    ("total token throughput (tok/s)", "total_token_throughput", None, True),
    ("goodput (req/s)", "goodput", None, True),
    ("TTFT p50 (ms)", "ttft_ms", "p50", False),
    ("TTFT p99 (ms)", "ttft_ms", "p99", False),
    ("TPOT p50 (ms)", "tpot_ms", "p50", False),
    ("TPOT p99 (ms)", "tpot_ms", "p99", False),
    ("ITL p50 (ms)", "itl_ms", "p50", False),
    ("ITL p99 (ms)", "itl_ms", "p99", False),
    ("E2E p50 (ms)", "e2el_ms", "p50", False),
    ("E2E p99 (ms)", "e2el_ms", "p99", False),
    ("failed requests", "num_failed", None, False),
)
# Parts of a document that describe how the run was made (compared key by key).
SETTINGS = ("config", "server", "hardware", "llmserve_version", "git_commit")


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, leaf value) pairs of nested dicts; lists count as leaves."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def setting_differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, value in A, value in B) for every setting that differs."""
    flat_a, flat_b = (dict(flatten({k: doc.get(k) for k in SETTINGS})) for doc in (a, b))
    keys = sorted(set(flat_a) | set(flat_b))
    return [(k, flat_a.get(k), flat_b.get(k)) for k in keys if flat_a.get(k) != flat_b.get(k)]


def change(a: Any, b: Any, higher_is_better: bool) -> str:
    """B relative to A, e.g. '+12.5% better'."""
    if a is None or b is None:
        return "-"
    if a == b:
        return "same"
    if a == 0:
        return "new" if b else "same"
    delta = (b - a) / abs(a) * 100
    better = (delta > 0) == higher_is_better
    return f"{delta:+.1f}% {'better' if better else 'worse'}"


def compare_runs(run_a: dict[str, Any], run_b: dict[str, Any]) -> list[str]:
    lines = [f"{'':<32}{'A':>12}{'B':>12}  B vs A"]
    for label, key, stat, higher in COMPARED:
        a, b = (sweep_value(run["metrics"], key, stat) for run in (run_a, run_b))
        lines.append(f"{label:<32}{fmt(a):>12}{fmt(b):>12}  {change(a, b, higher)}")
    return lines


def compare(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str) -> str:
    lines = [
        f"A: {name_a} ({a['kind']}, {a['date']}, llmserve {a['llmserve_version']})",
        f"B: {name_b} ({b['kind']}, {b['date']}, llmserve {b['llmserve_version']})",
    ]
    differences = setting_differences(a, b)
    if differences:
        lines.append("settings that differ:")
        lines += [f"  {key}: {va!r} -> {vb!r}" for key, va, vb in differences]
    else:
        lines.append("settings: identical")
    runs_a, runs_b = a["runs"], b["runs"]
    if len(runs_a) != len(runs_b):
        lines.append(f"A has {len(runs_a)} runs, B has {len(runs_b)}: comparing the first ones")
    for run_a, run_b in zip(runs_a, runs_b, strict=False):
        same = run_a["label"] == run_b["label"]
        title = run_a["label"] if same else f"{run_a['label']} (A) vs {run_b['label']} (B)"
        lines.append(f"== {title} ==")
        lines += compare_runs(run_a, run_b)
    return "\n".join(lines)
