"""Issue 42: the Python a batch-1 CPU decode step spends around its fused layers' C++ calls
(engine/model/cpu_fused.py, LlamaForCausalLM.run_layers), with the layer kernel stubbed out so
only that Python is timed: the built-in SmolLM2 GGUF (`--quantization auto`, 30 fused layers),
one request decoded, each step's `run_layers` timed with `cpu_gguf.decode_layer` replaced by a
call that returns its inputs. One thread, microseconds a step: steadier on a shared machine
than the whole step (~12 ms), whose noise hides a change of this size.

    python -m bench.studies.layer_loop_python [--steps 2000] [--out bench/results/x.json]

Run it from each tree to compare (PYTHONPATH=TREE, from the tree's root).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from llmserve.bench.engine_driver import Driver, blocks_needed
from llmserve.bench.report import git_commit, hardware
from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine
from llmserve.kernels import cpu_gguf


def _stub(x: Any, residual: Any, *args: Any) -> tuple[Any, Any]:
    return x, x if residual is None else residual


def measure(steps: int) -> dict[str, Any]:
    """Per-step time of run_layers (microseconds) with the layer kernel stubbed."""
    config = EngineConfig(
        device="cpu", quantization="auto", seed=0, num_kv_blocks=blocks_needed([16], steps + 8, 16)
    )
    engine = Engine(config)
    model: Any = engine.model
    driver = Driver(engine)
    driver.start([list(range(100, 116))])
    real, times = model.run_layers, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        times.append((time.perf_counter() - t0) * 1e6)
        return out

    model.run_layers = timed
    kernel, cpu_gguf.decode_layer = cpu_gguf.decode_layer, _stub
    try:
        for _ in range(steps):
            driver.decode()
    finally:
        cpu_gguf.decode_layer = kernel
        del model.run_layers
    times = times[steps // 10 :]  # warm-up
    return {
        "steps": len(times),
        "run_layers_us_median": statistics.median(times),
        "run_layers_us_p10": statistics.quantiles(times, n=10)[0],
        "fused_layers": sum(getattr(m, "fused_decode", None) is not None for m in model.layers),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    load = os.getloadavg()[0]
    result = measure(args.steps)
    document = {
        "schema": "llmserve-layer-loop-python/1",
        "hardware": hardware(),
        "commit": git_commit(),
        "tree": str(Path.cwd()),
        "load_average_1min": [load, os.getloadavg()[0]],
        **result,
    }
    print(json.dumps({k: v for k, v in document.items() if k != "hardware"}))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
