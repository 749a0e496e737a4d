"""Issue 26's MoE measure on the CPU: the routed experts of one sparse layer as one grouped
operation (kernels/moe_reference.moe_experts: the (token, expert) pairs sorted by expert, one
product per expert segment) against a loop over the experts that finds each one's tokens with a
mask (HF transformers' way, `looped_experts` below), and against torch's own `_grouped_mm` on
the same sorted rows where torch has it.

    python -m bench.studies.moe_cpu [--out bench/results/moe_cpu.json] [--reps 30] [--threads 1]

Two float32 shapes, scaled down so that their weights fit beside other work: Mixtral's
(8 experts, top-2, a wide expert) and Qwen3-MoE's (64 experts, top-8, narrow experts). For each
token count the variants run alternately, `--reps` times, after two warm-up rounds, each after
96 MiB have been written to evict the weights from the caches; the medians are compared within
one run, so load from other processes falls on all of them alike. Every variant's output is
checked against the grouped one's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.report import hardware, save
from llmserve.kernels import moe_reference as moe_ref
from llmserve.kernels.reference import silu_and_mul

ROOT = Path(__file__).resolve().parents[2]

SHAPES = {
    # name: (hidden, expert intermediate, experts, top-k)
    "mixtral-shaped (H 512, I 1024, 8 experts, top-2)": (512, 1024, 8, 2),
    "qwen3-moe-shaped (H 512, I 256, 64 experts, top-8)": (512, 256, 64, 8),
}
Experts = Callable[..., torch.Tensor]
# Written before each timed call, so that no variant finds the weights in the caches the one
# before it warmed (a real model's experts do not fit in them; these scaled-down ones would).
FLUSH_BYTES = 96 << 20


def looped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The baseline: for each expert, its tokens by a mask, gathered, run, added back."""
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        tokens, slot = torch.where(ids == expert)
        if not tokens.numel():
            continue
        hidden = silu_and_mul(torch.nn.functional.linear(x[tokens], w13[expert]))
        rows = torch.nn.functional.linear(hidden, w2[expert]) * weights[tokens, slot, None]
        out.index_add_(0, tokens, rows)
    return out


def torch_grouped_mm_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The sorted rows through torch._grouped_mm (one call per weight, offsets per expert)."""
    pairs, tokens, counts = moe_ref.sort_by_expert(ids, 0, w13.shape[0])
    offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    rows = x.index_select(0, tokens)
    hidden = silu_and_mul(torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs))
    rows = torch._grouped_mm(hidden, w2.transpose(1, 2), offs=offs)
    rows = rows * weights.flatten().index_select(0, pairs).unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, tokens, rows)


def variants() -> dict[str, Experts]:
    found: dict[str, Experts] = {
        "grouped (ours)": moe_ref.moe_experts,
        "loop over experts": looped_experts,
    }
    if hasattr(torch, "_grouped_mm"):
        found["torch._grouped_mm"] = torch_grouped_mm_experts
    return found


def time_shape(shape: tuple[int, int, int, int], tokens: int, reps: int) -> dict[str, Any]:
    hidden, inter, num_experts, top_k = shape
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    logits = torch.randn(tokens, num_experts, generator=g)
    weights, ids = moe_ref.route(logits, top_k, renormalize=True)
    fns = variants()
    want = moe_ref.moe_experts(x, weights, ids, w13, w2)
    times: dict[str, list[float]] = {name: [] for name in fns}
    max_diff = {}
    for name, fn in fns.items():
        max_diff[name] = float((fn(x, weights, ids, w13, w2) - want).abs().max())
    flush = torch.zeros(FLUSH_BYTES // 4)
    for rep in range(reps + 2):
        for name, fn in fns.items():
            flush.add_(1.0)  # every variant starts with its weights out of the caches
            start = time.perf_counter()
            fn(x, weights, ids, w13, w2)
            if rep >= 2:
                times[name].append(round((time.perf_counter() - start) * 1e3, 4))
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["loop over experts"]
    return {
        "tokens": tokens,
        "experts_hit": int(ids.unique().numel()),
        "median_ms": medians,
        "speedup_vs_loop": {name: round(base / m, 2) for name, m in medians.items()},
        "max_abs_diff_vs_grouped": max_diff,
        "ms": times,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1,16,128")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "moe_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    results = []
    for name, shape in SHAPES.items():
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = time_shape(shape, tokens, args.reps)
            results.append({"shape": name, **row})
            cells = "  ".join(
                f"{v}: {m:.3f} ms ({row['speedup_vs_loop'][v]:.2f}x)"
                for v, m in row["median_ms"].items()
            )
            print(f"{name} T={tokens}: {cells}", flush=True)
    doc = {
        "hardware": hardware(torch_threads=True),
        "reps": args.reps,
        "load_average_1_5_15_before": load_before,
        "load_average_1_5_15_after": os.getloadavg(),
        "note": "the machine's 2 cores were shared with other sessions' work while this ran",
        "results": results,
    }
    save(doc, args.out)
    print(f"raw JSON: {args.out}")


if __name__ == "__main__":
    main()
