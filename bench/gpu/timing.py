"""Timing on the GPU for the benchmarks: CUDA events around replays of a CUDA graph of
back-to-back calls, after warm-up, medians (bench/gpu/kernels_bench.py,
bench/studies/int8_bench.py)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

import torch


def time_ms(
    fn: Callable[[], Any], target_ms: float = 3.0, replays: int = 7, graph: bool = True
) -> dict[str, Any]:
    """Median ms per call over `replays` replays of a CUDA graph of back-to-back calls (eager
    with events when graph=False, for code that synchronizes, or if capture fails)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(64, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3))))

    def eager() -> None:
        for _ in range(reps):
            fn()

    method, run = "eager", eager
    if graph:
        try:
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                eager()
            method, run = "graph", cuda_graph.replay
        except Exception as err:  # some torch backends refuse capture: time eagerly instead
            method = f"eager ({type(err).__name__})"
            torch.cuda.synchronize()

    run()
    samples = []
    for _ in range(replays):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / reps)
    return {"ms": statistics.median(samples), "samples_ms": samples, "reps": reps, "how": method}


def attempt(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:400]}


def free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
