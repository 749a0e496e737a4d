"""Issue 40's Mamba-2 decode step on the CPU: one mixer layer (engine/model/mamba2.py) over a
step of R one-token decode rows, each from and back into its state slot, with the rows taken
together (`Mamba2Mixer.decode_rows`: one gather, the conv as one product, one batched
`ssd_update`, one scatter) against one by one (`batch_decode = False`, the path before).

    python -m bench.studies.mamba2_decode_rows_cpu [--out bench/results/mamba2_decode_rows_cpu.json]
        [--reps 15] [--threads 0] [--rows 1,4,16,64]

The layer at llmserve/bench/step_arms.py's Mamba-2 shape (hidden 576; 18 heads x 64, 1 group,
state 128, conv 4), float32, random weights; the two ways alternate `--reps` times after two
warm-up rounds and their medians are compared within one run; their outputs and states are checked
equal first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from llmserve.bench.report import hardware, save
from llmserve.common.mamba2_config import Mamba2Config
from llmserve.engine.kv.state import StateBatch, StatePool
from llmserve.engine.model.mamba2 import Mamba2Mixer

ROOT = Path(__file__).resolve().parents[2]
HIDDEN = 576
SHAPE = Mamba2Config(num_heads=18, head_dim=64, num_groups=1, state_size=128, conv_kernel=4)


def make_mixer() -> Mamba2Mixer:
    torch.manual_seed(0)
    mixer = Mamba2Mixer(HIDDEN, SHAPE, 1e-5, 0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn_like(param) * 0.05)
        mixer.A_log.copy_(torch.rand(SHAPE.num_heads))
    return mixer


def step(mixer: Mamba2Mixer, pool: Any, rows: int, hidden: torch.Tensor) -> torch.Tensor:
    ctx = SimpleNamespace(
        cu_seqlens_q=list(range(rows + 1)),
        seq_lens=[129] * rows,
        state=StateBatch(pool, list(range(rows))),
    )
    with torch.no_grad():
        return mixer(torch.zeros(rows, dtype=torch.long), hidden, ctx)


def time_rows(mixer: Mamba2Mixer, rows: int, reps: int) -> dict[str, Any]:
    config = SimpleNamespace(state_layout=SHAPE.layout(), num_state_layers=1)
    pools = {way: StatePool(config, rows, torch.float32, torch.device("cpu")) for way in (0, 1)}
    for pool in pools.values():
        torch.manual_seed(rows)
        pool.conv.copy_(torch.randn_like(pool.conv))
        pool.recurrent.copy_(torch.randn_like(pool.recurrent))
    hidden = torch.randn(rows, HIDDEN)
    ways = {"together": True, "one_by_one": False}
    outs = []
    for (_, batched), pool in zip(ways.items(), pools.values(), strict=True):
        mixer.batch_decode = batched
        outs.append((step(mixer, pool, rows, hidden), pool.recurrent.clone()))
    err = float((outs[0][0] - outs[1][0]).abs().max() / outs[1][0].abs().max())
    assert err < 1e-5 and torch.allclose(outs[0][1], outs[1][1], atol=1e-5), err
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(reps + 2):  # the first two: a warm-up, not kept
        for (name, batched), pool in zip(ways.items(), pools.values(), strict=True):
            mixer.batch_decode = batched
            start = time.perf_counter()
            step(mixer, pool, rows, hidden)
            if rep >= 2:
                times[name].append((time.perf_counter() - start) * 1e3)
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "median_ms": median, "speedup": median["one_by_one"] / median["together"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    out = ROOT / "bench/results/mamba2_decode_rows_cpu.json"
    parser.add_argument("--out", type=Path, default=out)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--rows", default="1,4,16,64")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    mixer = make_mixer()
    results = [time_rows(mixer, int(r), args.reps) for r in args.rows.split(",")]
    for row in results:
        m = row["median_ms"]
        print(f"rows={row['rows']}: together {m['together']:.2f} ms, one by one "
              f"{m['one_by_one']:.2f} ms ({row['speedup']:.2f}x)", flush=True)  # fmt: skip
    save(
        {
            "hardware": hardware(torch_threads=True),
            "shape": {"hidden": HIDDEN, "heads": 18, "head_dim": 64, "groups": 1, "state": 128},
            "reps": args.reps,
            "load_average_1_5_15_before": load_before,
            "load_average_1_5_15_after": os.getloadavg(),
            "results": results,
        },
        args.out,
    )
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
