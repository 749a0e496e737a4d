"""Drives a backend through a workload on an arrival schedule; returns what each request saw."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llmserve.bench.arrivals import ArrivalConfig, arrival_offsets
from llmserve.bench.backends import Backend, BackendError
from llmserve.bench.metrics import RequestRecord
from llmserve.bench.workload import BenchRequest


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, label: str, enabled: bool) -> Any:
    """A tqdm bar of completed requests on stderr, or one that draws nothing (disabled, stderr
    no terminal, or no tqdm installed)."""
    if not enabled or not sys.stderr.isatty():
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True)


async def warm_up(backend: Backend, requests: Sequence[BenchRequest], num_warmups: int) -> None:
    """Send the first num_warmups requests (at most 16 output tokens each) at once and wait;
    raise BackendError if none succeeds, naming the first failure. Nothing is recorded."""
    if num_warmups < 1 or not requests:
        return
    chosen = [replace(r, max_tokens=min(r.max_tokens, 16)) for r in requests[:num_warmups]]
    records = [RequestRecord(i, r.num_prompt_tokens, r.max_tokens) for i, r in enumerate(chosen)]
    sent = time.perf_counter()
    await asyncio.gather(
        *(backend.send(r, rec, sent) for r, rec in zip(chosen, records, strict=True))
    )
    if not any(rec.ok for rec in records):
        first = records[0]
        raise BackendError(f"the warm-up request failed: {first.status}: {first.error}")


async def run_benchmark(
    backend: Backend,
    requests: Sequence[BenchRequest],
    arrivals: ArrivalConfig,
    progress: bool = False,
) -> list[RequestRecord]:
    """Send every request at its due time (arrivals), at most max_concurrency in flight; return
    one record per request, in workload order. Times are relative to the first due time."""
    offsets = arrival_offsets(len(requests), arrivals)
    limit = asyncio.Semaphore(arrivals.max_concurrency) if arrivals.max_concurrency else None
    in_flight = limit or contextlib.nullcontext()
    records = [RequestRecord(i, r.num_prompt_tokens, r.max_tokens) for i, r in enumerate(requests)]
    bar = progress_bar(len(requests), arrivals.label, progress)
    start = time.perf_counter()

    async def send(i: int) -> None:
        async with in_flight:
            sent = time.perf_counter()
            records[i].start_s = sent - start
            await backend.send(requests[i], records[i], sent)
        bar.update(1)

    tasks = []
    for i, offset in enumerate(offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
    try:
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return records


async def measure_stack(
    stack: Any,
    backend: Backend,
    requests: list[BenchRequest],
    arrivals: ArrivalConfig,
    num_warmups: int,
) -> tuple[list[Any], dict[str, Any]]:
    """Warm up, then send requests on arrivals: the records and the scheduler's counters over
    the measured part (stats_delta). The backend is closed after."""
    from llmserve.stats import stats_delta

    try:
        await warm_up(backend, requests, num_warmups)
        before = await asyncio.to_thread(stack.scheduler_stats)
        records = await run_benchmark(backend, requests, arrivals)
        after = await asyncio.to_thread(stack.scheduler_stats)
    finally:
        await backend.close()
    return records, stats_delta(before, after)
