"""From per-request timings to the reported statistics (TTFT, TPOT, ITL, E2E, throughput,
goodput). Pure functions; the definitions are vLLM's (`vllm bench serve`), so numbers compare
across tools: docs/benchmarks.md#metrics. ITL is per chunk (a chunk holding several tokens is
one gap), TPOT per token. Failed requests are counted by status and left out of every latency
and throughput figure. Percentiles interpolate linearly between order statistics (numpy's
default).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `start_s` from the benchmark's start,
    the others from the moment the request was sent."""

    index: int
    num_prompt_tokens: int
    max_tokens: int
    start_s: float = 0.0
    status: str = "OK"  # "OK", a gRPC status code name, or "HTTP <code>"
    error: str = ""
    chunk_times_s: list[float] = field(default_factory=list)  # each token-carrying chunk
    chunk_num_tokens: list[int] = field(default_factory=list)
    latency_s: float = 0.0  # until the stream ended, or the request failed
    finish_reason: str | None = None
    # How output tokens were counted: "token_ids" (gRPC), "usage" or "chunks" (HTTP, no usage).
    output_tokens_from: str = "token_ids"
    token_ids: list[int] | None = None  # kept only when asked (--save-detailed)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def end_s(self) -> float:
        return self.start_s + self.latency_s


def ttft_s(record: RequestRecord) -> float | None:
    return record.chunk_times_s[0] if record.chunk_times_s else None


def tpot_s(record: RequestRecord) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
    first = ttft_s(record)
    if first is None or record.num_output_tokens < 2:
        return None
    return (record.latency_s - first) / (record.num_output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile, linear between order statistics; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = (len(ordered) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max of values; all None when there are none."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    return {
        "mean": sum(values) / len(values),
        **{f"p{q}": percentile(values, q) for q in PERCENTILES},
        "max": max(values),
    }


def duration_s(records: Sequence[RequestRecord]) -> float:
    """From the benchmark's start (time 0) to the last request's end."""
    return max((r.end_s for r in records), default=0.0)


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once (a request ending as another starts is not overlap)."""
    events = sorted([(r.start_s, 1) for r in records] + [(r.end_s, -1) for r in records])
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def meets_targets(record: RequestRecord, targets_ms: dict[str, float]) -> bool:
    """Whether a completed request meets every target (keys from GOODPUT_METRICS)."""
    first = ttft_s(record)
    measured = {
        "ttft": (first or 0.0) * 1e3,
        "tpot": (tpot_s(record) or 0.0) * 1e3,
        "e2el": record.latency_s * 1e3,
    }
    return all(measured[name] <= limit for name, limit in targets_ms.items())


def error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failed requests by status, most frequent first."""
    return dict(Counter(r.status for r in records if not r.ok).most_common())


def summarize(
    records: Sequence[RequestRecord], goodput_targets_ms: dict[str, float] | None = None
) -> dict[str, Any]:
    """Every reported statistic of one run. Latencies in ms, throughputs per second."""
    done = [r for r in records if r.ok]
    duration = duration_s(records)
    num_input = sum(r.num_prompt_tokens for r in done)
    num_output = sum(r.num_output_tokens for r in done)

    def per_s(count: float) -> float | None:
        return count / duration if duration > 0 else None

    ttfts = [t * 1e3 for r in done if (t := ttft_s(r)) is not None]
    tpots = [t * 1e3 for r in done if (t := tpot_s(r)) is not None]
    itls = [(b - a) * 1e3 for r in done for a, b in itertools.pairwise(r.chunk_times_s)]
    good = None
    if goodput_targets_ms:
        good = sum(meets_targets(r, goodput_targets_ms) for r in done)
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "num_short_outputs": sum(r.num_output_tokens < r.max_tokens for r in done),
        "duration_s": duration,
        "total_input_tokens": num_input,
        "total_output_tokens": num_output,
        "request_throughput": per_s(len(done)),
        "input_throughput": per_s(num_input),
        "output_throughput": per_s(num_output),
        "total_token_throughput": per_s(num_input + num_output),
        "num_good_requests": good,
        "goodput": per_s(good) if good is not None else None,
        "max_in_flight": max_in_flight(records),
        "ttft_ms": distribution(ttfts),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution(itls),
        "e2el_ms": distribution([r.latency_s * 1e3 for r in done]),
        "errors": error_counts(records),
    }


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    targets: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput {item!r}: expected NAME:MILLISECONDS with NAME one of "
                f"{', '.join(GOODPUT_METRICS)}"
            )
        try:
            targets[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if targets[name] < 0:
            raise ValueError(f"--goodput {item!r}: the target must be >= 0 ms")
    return targets
