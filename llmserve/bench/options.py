"""What the `llmserve bench` commands build from their options: the arrival schedules, the
workload and its requests, the sampling settings, the settings saved with a result, and where
the result goes."""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig
from llmserve.bench.backends import SamplingConfig
from llmserve.bench.metrics import parse_goodput
from llmserve.bench.workload import BenchRequest, WorkloadConfig


def parse_list(text: str | None, cast: type, name: str) -> list[Any]:
    """'1,2,inf' -> [1.0, 2.0, inf]; None -> [None]."""
    if text is None:
        return [None]
    try:
        return [cast(item) for item in str(text).split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"--{name} {text!r}: expected comma-separated numbers") from None


def arrival_configs(args: argparse.Namespace) -> list[ArrivalConfig]:
    """One per run: a sweep over rates or over concurrencies (not both)."""
    rates = parse_list(args.request_rate, float, "request-rate")
    limits = parse_list(args.max_concurrency, int, "max-concurrency")
    if len(rates) > 1 and len(limits) > 1:
        raise ValueError("sweep over --request-rate or over --max-concurrency, not both")
    return [
        ArrivalConfig(rate, args.burstiness, limit, args.seed) for rate in rates for limit in limits
    ]


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        dataset=args.dataset_name,
        num_requests=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        path=args.dataset_path,
        chat=args.chat,
        seed=args.seed,
    )


def sampling_config(args: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(
        temperature=args.temperature, ignore_eos=args.ignore_eos, timeout_s=args.request_timeout
    )


RequestsFor = Callable[[int], list[BenchRequest]]


def requests_maker(config: WorkloadConfig, tokenizer_path: str | None) -> RequestsFor:
    """variant -> that variant of the workload (see build_workload), each built once. Builds
    variant 0 now, so a bad tokenizer or data set fails here (ValueError or OSError)."""
    from llmserve.bench.workload import build_workload
    from llmserve.common.model_config import resolve_model_path
    from llmserve.gateway.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_model_path(resolve_model_path(tokenizer_path))
    requests_for = functools.cache(lambda variant: build_workload(config, tokenizer, variant))
    requests_for(0)
    return requests_for


def workload_stats(requests: Sequence[BenchRequest]) -> dict[str, Any]:
    """Mean / min / max prompt and output lengths of the workload as built."""
    out: dict[str, Any] = {}
    for name, values in (
        ("prompt_tokens", [r.num_prompt_tokens for r in requests]),
        ("output_tokens", [r.max_tokens for r in requests]),
    ):
        out[name] = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    return out


def common_config(args: argparse.Namespace, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    return {
        "label": args.label,
        "workload": workload_config(args).to_json(),
        "workload_stats": workload_stats(requests),
        "tokenizer": args.tokenizer,
        "sampling": vars(sampling_config(args)),
        "goodput_targets_ms": parse_goodput(args.goodput),
        "num_warmups": args.num_warmups,
    }


def result_path(args: argparse.Namespace, kind: str) -> Path:
    """--output, else llmserve-bench-KIND-DATE-TIME.json here."""
    return Path(args.output or f"llmserve-bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json")
