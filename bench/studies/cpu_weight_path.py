"""Issue 42's crossover: one decoder layer's four products (qkv, o, gate_up, down) of the built-in
model, and its LM head, on the GGUF blocks (kernels/cpu_gguf.cpp's dot products) against the
dense copy --quantization auto makes (engine/model/cpu_weights.py: oneDNN-packed, float32 here or
bfloat16 where the CPU computes it), at 1 to 128 rows, in-process.

    python -m bench.studies.cpu_weight_path [--threads 1 2] [--repeats 15]
        [--out bench/results/cpu_weight_path.json]

Each figure is the fastest of --repeats runs (the least disturbed by other processes on a shared
machine), the two forms alternating. Also saved: what the engine itself chose at start (its
WeightPath: crossover rows, dtype, reason) and the CPU features kernels/cpu_features.py found.
"""

# ruff: noqa: E402 (libgomp's wait policy is set before torch loads it)
from __future__ import annotations

from llmserve.engine.step.cpu_threads import configure_openmp

configure_openmp()

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from llmserve.bench.report import hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.cpu_weights import dense_head, dense_layers
from llmserve.engine.model.gguf_linear import GGUFLinear
from llmserve.engine.step.engine import Engine
from llmserve.kernels import cpu_features, cpu_gguf

ROOT = Path(__file__).resolve().parents[2]
ROWS = (1, 2, 4, 6, 8, 12, 16, 32, 64, 128)


def fastest_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def compare(projections: list[GGUFLinear], rows: int, repeats: int) -> tuple[float, float]:
    """(blocks ms, dense ms) of the projections' products on `rows` random rows."""
    gen = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, p.in_features, generator=gen) for p in projections]

    def blocks() -> None:
        for p, x in zip(projections, xs, strict=True):
            cpu_gguf.gguf_linear(x, p.blocks, p.ggml_type)

    def dense() -> None:
        for p, x in zip(projections, xs, strict=True):
            assert p.fast is not None
            cpu_gguf.dense_linear(x, p.fast)

    return fastest_ms(blocks, repeats), fastest_ms(dense, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_weight_path.json")
    args = p.parse_args()
    engine = Engine(EngineConfig(device="cpu", num_kv_blocks=16, seed=0, cpu_dense_rows=1))
    path = engine.model.weight_path
    layer = dense_layers(engine.model)[:4]
    head = dense_head(engine.model)
    results: list[dict[str, Any]] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in ROWS:
            load = os.getloadavg()[0]
            lb, ld = compare(layer, rows, args.repeats)
            hb, hd = compare([head], rows, max(3, args.repeats // 3)) if head else (0.0, 0.0)
            results.append(
                {
                    "threads": threads, "rows": rows, "layer_blocks_ms": lb, "layer_dense_ms": ld,
                    "head_blocks_ms": hb, "head_dense_ms": hd, "loadavg_1m": load,
                }
            )  # fmt: skip
            print(
                f"threads {threads} rows {rows:4d}: layer blocks {lb:7.2f} dense {ld:7.2f} ms "
                f"({lb / ld:4.2f}x); head blocks {hb:7.2f} dense {hd:7.2f} ms (load {load:.1f})",
                flush=True,
            )
    save(
        {
            "kind": "cpu_weight_path",
            "hardware": hardware(torch_threads=True),
            "cpu_features": sorted(cpu_features.features()),
            "engine_choice_at_start": {k: v for k, v in vars(path).items() if k != "steps"},
            "dense_dtype": path.dtype,
            "results": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
