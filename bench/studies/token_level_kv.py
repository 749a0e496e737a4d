"""What token-level KV (`--block-size 1`, LightLLM's TokenAttention) buys and costs, against
blocks of 16 and 32, on one workload of varied lengths (seeded):

    waste       KV slots a request holds but does not fill (its last block's empty tail), at its
                final length and averaged over its decode steps, per request
    fit         the largest batch a fixed pool holds: the workload's requests at their final
                lengths taken in order until the pool's blocks run out; and through the real
                Scheduler (fake tokens, no engine), the peak and mean running requests and the
                preemptions while it serves the whole workload from that pool
    tables      the engine's per-step cost of the step's padded block tables, rebuilt from the
                mirror's lists (before) and kept between steps (engine/step_inputs.BlockTables)
    scheduler   the scheduler's per-step cost (schedule(), update(), and the plan's conversion to
                engine.proto) for decode steps of 64 requests holding 1,000-4,000 tokens in all
    engine      the built-in model's decode step on the CPU engine (batch 8, 256-token
                contexts; the block sizes take turns 3 times): the forward reads
                token-granular tables with tensor ops

    python -m bench.studies.token_level_kv [--out bench/results/token_level_kv.json] [--quick]
        [--keep-engine]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from llmserve.bench.report import hardware, save
from llmserve.protos import common_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZES = (1, 16, 32)
POOLS = {"mixed": 65_536, "short": 8_192}  # tokens: a few dozen to a hundred requests at once
VOCAB = 32_000


# (prompt range, output range), each log-uniform: short requests common, a long tail.
WORKLOADS = {"mixed": ((16, 2048), (8, 512)), "short": ((8, 256), (4, 128))}


def workload(name: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of n requests: "mixed" as chat and RAG traffic mixes
    them, "short" as short chat turns."""
    rng = random.Random(seed)
    (p_lo, p_hi), (o_lo, o_hi) = WORKLOADS[name]

    def log_uniform(lo: int, hi: int) -> int:
        return round(lo * (hi / lo) ** rng.random())

    return [(log_uniform(p_lo, p_hi), log_uniform(o_lo, o_hi)) for _ in range(n)]


def tail(length: int, block_size: int) -> int:
    return -length % block_size


def waste(requests: list[tuple[int, int]], block_size: int) -> dict[str, Any]:
    final = [tail(p + o, block_size) for p, o in requests]
    over_life = [
        statistics.fmean(tail(p + t, block_size) for t in range(o + 1)) for p, o in requests
    ]
    held = [p + o + w for (p, o), w in zip(requests, final, strict=True)]
    return {
        "wasted_slots_per_request_final": round(statistics.fmean(final), 2),
        "wasted_slots_per_request_over_decode": round(statistics.fmean(over_life), 2),
        "wasted_fraction_of_held_kv": round(sum(final) / sum(held), 4),
    }


def fits(requests: list[tuple[int, int]], block_size: int, pool: int) -> int:
    """How many of the requests, in order, fit the pool at once at their final lengths."""
    free = pool // block_size
    for i, (p, o) in enumerate(requests):
        free -= -(-(p + o) // block_size)
        if free < 0:
            return i
    return len(requests)


def make_scheduler(block_size: int, num_tokens: int, max_num_seqs: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192)
    return Scheduler(config, num_tokens // block_size, block_size, 4096, VOCAB, (2,))


def request(i: int, prompt: int, output: int) -> Request:
    tokens = [3 + (i * 7919 + j) % (VOCAB - 3) for j in range(prompt)]  # no shared prefixes
    return Request(f"r{i}", i + 1, tokens, common_pb2.SamplingParams(), output, ignore_eos=True)


def serve(requests: list[tuple[int, int]], block_size: int, pool: int) -> dict[str, Any]:
    """The whole workload through the real Scheduler from the fixed pool, tokens made up."""
    s = make_scheduler(block_size, pool, max_num_seqs=1024)
    for i, (p, o) in enumerate(requests):
        s.add(request(i, p, o))
    running: list[int] = []
    while s.has_work:
        plan = s.schedule()
        s.update(plan, [5] * len(plan.rows))
        running.append(len(plan.rows))
    return {
        "peak_running": max(running),
        "mean_running": round(statistics.fmean(running), 1),
        "num_steps": len(running),
        "num_preemptions": s.counters.num_preemptions,
    }


def scheduler_cost(block_size: int, num_tokens: int, num_rows: int, steps: int) -> dict[str, Any]:
    """Median ms per decode step of schedule(), update() and plan_to_proto with num_rows
    requests holding num_tokens tokens in all (prompts of num_tokens / num_rows)."""
    s = make_scheduler(block_size, 4 * num_tokens + 64 * num_rows, max_num_seqs=num_rows)
    for i in range(num_rows):
        s.add(request(i, num_tokens // num_rows, 10 * steps))
    while s.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in s.running):
        plan = s.schedule()
        s.update(plan, [5] * len(plan.rows))
    times: dict[str, list[float]] = {"schedule_ms": [], "update_ms": [], "to_proto_ms": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = s.schedule()
        t1 = time.perf_counter()
        plan_to_proto(plan)
        t2 = time.perf_counter()
        s.update(plan, [5] * len(plan.rows))
        t3 = time.perf_counter()
        assert len(plan.running) == num_rows, "every request decodes each timed step"
        for name, ms in (
            ("schedule_ms", t1 - t0),
            ("to_proto_ms", t2 - t1),
            ("update_ms", t3 - t2),
        ):
            times[name].append(ms * 1e3)
    row: dict[str, Any] = {"block_size": block_size, "running_tokens": num_tokens}
    row.update({k: round(statistics.median(v), 4) for k, v in times.items()})
    return row


def table_build(block_size: int, num_rows: int, context: int, steps: int) -> dict[str, Any]:
    """Median ms per step to build the step's padded block tables for num_rows decoding rows
    of `context` tokens: rebuilt from the Python lists (padded_block_tables, the engine's way
    before) and kept between steps (BlockTables, the runner's now)."""
    import torch

    from llmserve.engine.step.inputs import BlockTables, padded_block_tables

    cpu = torch.device("cpu")
    n = -(-context // block_size)
    tables = [list(range(i * n, (i + 1) * n)) for i in range(num_rows)]
    kept = BlockTables()
    times: dict[str, list[float]] = {"rebuilt_ms": [], "kept_ms": []}
    for step in range(steps):
        for t in tables:
            t.append(num_rows * n + step)  # one block per row per step: the worst case
        width = n + step + 1
        t0 = time.perf_counter()
        rebuilt = padded_block_tables(tables, width, cpu)
        t1 = time.perf_counter()
        padded = kept.padded(tables, width, cpu)
        t2 = time.perf_counter()
        assert torch.equal(padded, rebuilt)
        times["rebuilt_ms"].append((t1 - t0) * 1e3)
        times["kept_ms"].append((t2 - t1) * 1e3)
    row: dict[str, Any] = {"block_size": block_size, "rows": num_rows, "context": context}
    return row | {k: round(statistics.median(v[1:]), 3) for k, v in times.items()}


def engine_steps(batch: int, context: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    """The decode step of the built-in model at each block size, the block sizes taking turns
    `rounds` times (each engine built once), so a machine whose load drifts slows them alike;
    a block size's figure is the median of its rounds' medians."""
    from llmserve.bench.engine_driver import time_decode_steps
    from llmserve.common.model_config import builtin_model_path
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    max_len = context + steps + 8
    engines = {
        bs: Engine(EngineConfig(
            model=str(builtin_model_path()), device="cpu", block_size=bs,
            num_kv_blocks=batch * -(-max_len // bs), max_model_len=max_len,
        ))
        for bs in BLOCK_SIZES
    }  # fmt: skip
    runs: dict[int, list[dict[str, Any]]] = {bs: [] for bs in BLOCK_SIZES}
    for _ in range(rounds):
        for bs, engine in engines.items():
            runs[bs].append(time_decode_steps(engine, batch, steps, prompt_len=context))
    return [
        {
            "block_size": bs, "batch": batch, "context": context,
            "step_ms_median": round(statistics.median(r["step_ms_median"] for r in rs), 2),
            "round_medians_ms": [r["step_ms_median"] for r in rs],
            "first_tokens": rs[0]["first_tokens"],
        }
        for bs, rs in runs.items()
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/token_level_kv.json")
    parser.add_argument("--quick", action="store_true", help="small sizes: checks the script")
    parser.add_argument(
        "--keep-engine", action="store_true",
        help="rerun the rest and keep the engine rows already in --out (they take minutes)",
    )  # fmt: skip
    args = parser.parse_args()
    kept_engine = []
    if args.keep_engine and args.out.exists():
        kept_engine = json.loads(args.out.read_text()).get("engine", [])
    steps = 5 if args.quick else 40
    doc: dict[str, Any] = {"hardware": hardware(torch_threads=not args.quick), "memory": []}
    for name, pool in POOLS.items():
        requests = workload(name, 64 if args.quick else 512)
        shape = {
            "workload": name, "num_requests": len(requests), "pool_tokens": pool,
            "mean_prompt": round(statistics.fmean(p for p, _ in requests), 1),
            "mean_output": round(statistics.fmean(o for _, o in requests), 1),
        }  # fmt: skip
        doc["memory"] += [
            {**shape, "block_size": bs, **waste(requests, bs),
             "fits_at_final_lengths": fits(requests, bs, pool), **serve(requests, bs, pool)}
            for bs in BLOCK_SIZES
        ]  # fmt: skip
    # Each shape 3 times, the block sizes taking turns; the best median of the three: a step of
    # the shared VM's load landing on one of them (once 6.6 ms against 1.0) is not the code's.
    runs = [scheduler_cost(bs, n, 64, steps) for _ in range(3) for n in (1000, 2000, 4000)
            for bs in BLOCK_SIZES]  # fmt: skip
    doc["scheduler"] = [
        min((r for r in runs if (r["block_size"], r["running_tokens"]) == (bs, n)),
            key=lambda r: r["schedule_ms"] + r["update_ms"])
        for n in (1000, 2000, 4000) for bs in BLOCK_SIZES
    ]  # fmt: skip
    doc["block_tables"] = [
        table_build(bs, 64, context, steps) for context in (256, 2048) for bs in BLOCK_SIZES
    ]
    save(doc, args.out)  # the engine's rows take minutes on a loaded CPU: the rest first
    if kept_engine:  # the engine's rows of the last run
        doc["engine"] = kept_engine
        save(doc, args.out)
    elif not args.quick:
        doc["engine"] = engine_steps(8, 256, 10, rounds=3)
        save(doc, args.out)
    for section in ("memory", "scheduler", "block_tables", "engine"):
        for row in doc.get(section, []):
            print(section, {k: v for k, v in row.items() if k != "step_ms"})


if __name__ == "__main__":
    main()
