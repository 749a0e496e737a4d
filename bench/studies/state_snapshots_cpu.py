"""Issue 40's state snapshots on the CPU: what a hybrid model's prefix cache costs and saves.
Qwen3-Next's layout at SmolLM2-135M's shape (llmserve/bench/step_arms.py's `qwen3_next`
family, dummy weights, float32), one in-process Engine with --state-snapshot-slots 4, driven
by a real Scheduler through the contract, one request at a time (its time to first token is
the engine time of the steps until it samples):

- off:  a fresh prompt, the scheduler without snapshot slots (today's path: one step);
- miss: a fresh prompt with snapshots (its chunk cut at the last full block, a snapshot taken
        after it, then the tail: two steps);
- hit:  the miss's prompt again (a hit restored from that snapshot, the tail only).

    python -m bench.studies.state_snapshots_cpu [--out bench/results/state_snapshots_cpu.json]
        [--reps 5] [--prompt-len 512] [--threads 0]

The three alternate `--reps` times after one warm-up round; medians and minima (the least
disturbed run, on a machine shared with other jobs) compared within the run.
Also the time of one snapshot copy (StatePool.copy of one slot) and the slot's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.report import hardware, save
from llmserve.bench.step_arms import CONFIGS, FAMILIES, prompts
from llmserve.common.sampling import normalized
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto, result_to_proto
from llmserve.engine.kv.state import state_bytes_per_slot
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import SamplingParams
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import apply_result, plan_to_proto

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def make_engine(workdir: Path) -> Engine:
    base = json.loads((CONFIGS / "smollm2-135m" / "config.json").read_text())
    (workdir / "config.json").write_text(json.dumps({**base, **FAMILIES["qwen3_next"]}))
    return Engine(
        EngineConfig(model=str(workdir), load_format="dummy", quantization="none", device="cpu",
                     num_kv_blocks=256, block_size=BLOCK_SIZE, max_num_seqs=4,
                     max_num_batched_tokens=2048, state_snapshot_slots=4)
    )  # fmt: skip


def scheduler(engine: Engine, snapshots: bool) -> Scheduler:
    info = engine.info
    engine.reset()
    return Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048),
        info.num_blocks, info.block_size, info.max_model_len, info.vocab_size, info.eos_token_ids,
        num_state_slots=info.num_state_slots,
        num_state_snapshot_slots=info.num_state_snapshot_slots if snapshots else 0,
    )  # fmt: skip


def first_token(engine: Engine, sched: Scheduler, seq_id: int, prompt: list[int]) -> dict:
    """Run one request to its first token: the engine time (ms), the steps, the cached tokens."""
    request = Request(f"r{seq_id}", seq_id, prompt, normalized(SamplingParams(temperature=0.0)), 1)
    sched.add(request)
    ms, steps = 0.0, 0
    while sched.has_work:
        plan = sched.schedule()
        if plan.is_empty:
            continue
        data = plan_from_proto(plan_to_proto(plan))
        start = time.perf_counter()
        output = engine.step(data)
        ms += (time.perf_counter() - start) * 1e3
        steps += 1
        apply_result(sched, plan, result_to_proto(plan.step_id, output, 0.0))
    sched.check_integrity()
    return {"ms": ms, "steps": steps, "cached_tokens": request.num_cached_tokens}


def copy_ms(engine: Engine, reps: int) -> float:
    pool = engine.state_pool
    assert pool is not None
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        pool.copy([0], [pool.num_slots])
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def run(engine: Engine, reps: int, prompt_len: int) -> dict[str, Any]:
    fresh = iter(prompts(2 * (reps + 1), prompt_len))
    times: dict[str, list[dict]] = {"off": [], "miss": [], "hit": []}
    for rep in range(reps + 1):  # the first: a warm-up, not kept
        off = first_token(engine, scheduler(engine, False), 1, next(fresh))
        on = scheduler(engine, True)
        prompt = next(fresh)
        miss = first_token(engine, on, 1, prompt)
        hit = first_token(engine, on, 2, prompt)
        if rep:
            for name, value in (("off", off), ("miss", miss), ("hit", hit)):
                times[name].append(value)
    median = {name: statistics.median(t["ms"] for t in ts) for name, ts in times.items()}
    best = {name: min(t["ms"] for t in ts) for name, ts in times.items()}
    return {
        "prompt_len": prompt_len,
        "median_ttft_ms": median,
        # best of the reps: on a machine shared with other jobs the least disturbed run
        "min_ttft_ms": best,
        "min_miss_over_off": best["miss"] / best["off"],
        "min_hit_over_off": best["hit"] / best["off"],
        "steps": {name: ts[0]["steps"] for name, ts in times.items()},
        "cached_tokens": {name: ts[0]["cached_tokens"] for name, ts in times.items()},
        "miss_over_off": median["miss"] / median["off"],
        "hit_over_off": median["hit"] / median["off"],
        "raw_ms": {name: [t["ms"] for t in ts] for name, ts in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/state_snapshots_cpu.json")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as workdir:
        engine = make_engine(Path(workdir))
    result = run(engine, args.reps, args.prompt_len)
    config = engine.local_config
    result["snapshot_copy_ms"] = copy_ms(engine, 20)
    result["state_bytes_per_slot"] = state_bytes_per_slot(config, torch.float32)
    m, r = result["median_ttft_ms"], result
    print(f"prompt {args.prompt_len}: first token off {m['off']:.1f} ms, miss {m['miss']:.1f} ms "
          f"({r['miss_over_off']:.2f}x), hit {m['hit']:.1f} ms ({r['hit_over_off']:.2f}x); one "
          f"snapshot copy {r['snapshot_copy_ms']:.3f} ms of {r['state_bytes_per_slot'] / 2**20:.1f}"
          " MiB", flush=True)  # fmt: skip
    b = r["min_ttft_ms"]
    print(
        f"best of {args.reps}: off {b['off']:.1f} ms, miss {b['miss']:.1f} ms "
        f"({r['min_miss_over_off']:.2f}x), hit {b['hit']:.1f} ms ({r['min_hit_over_off']:.2f}x)"
    )
    save(
        {
            "hardware": hardware(torch_threads=True),
            "model": "qwen3_next family at SmolLM2-135M's shape (step_arms.FAMILIES), dummy, fp32",
            "block_size": BLOCK_SIZE,
            "reps": args.reps,
            "load_average_1_5_15_before": load_before,
            "load_average_1_5_15_after": os.getloadavg(),
            "result": result,
        },
        args.out,
    )
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
