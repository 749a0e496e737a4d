"""Issue 41's decode figure: an 8B-shaped model with its projections held as a quantized
checkpoint ships them (W4A16: int4, group 128, zero points; FP8-block: e4m3, 128 x 128 block
scales), served by kernels/w4a16_gemm.cu and fp8_block_gemm.cu through engine/model/
checkpoint_linear_cuda.py, against the same engine in bf16.

One Engine (configs/<shape>, dummy bf16 weights, CUDA graphs, contexts of --input-len tokens) is
built once; its decode step is timed at each batch in bf16, then every projection but the LM
head is swapped for a CudaCheckpointLinear over random weights of the format (built on the GPU:
random levels / e4m3 values and scales, no download, no checkpoint on disk), the decode graphs
are captured again, and the step is timed again; likewise for the next format. Random weights
say nothing about quality (the emulator tests and tests/engine/model/test_checkpoint_schemes.py
do); the step times are what the kernels give at these shapes. Writes OUT/kept_decode_<shape>.json
and prints a table.

    python3 -m bench.gpu.kept_decode --shape llama-3-8b --out DIR [--decode-steps 20]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

FORMATS = ("w4a16", "fp8-block")


def swap_projections(engine: Any, fmt: str) -> dict[str, Any]:
    """Every Linear of engine.model but the LM head -> a CudaCheckpointLinear of `fmt` with
    random weights of its shape; the decode graphs captured again over the new layers."""
    import torch

    from bench.gpu.quant_gemm_bench import random_fp8_block, random_w4a16
    from llmserve.engine.kv.cache import layer_views
    from llmserve.engine.model.checkpoint_linear_cuda import CudaCheckpointLinear
    from llmserve.engine.model.layers import Linear
    from llmserve.engine.step.graph_capture import capture_graphs

    model, device = engine.model, engine.device
    engine.runner.graphs = None  # the old graphs hold the old layers' memory
    swapped, nbytes = 0, 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        n, k = module.weight.shape
        make = random_w4a16 if fmt == "w4a16" else random_fp8_block
        layer = CudaCheckpointLinear.of(make(n, k, device))
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, layer)
        swapped, nbytes = swapped + 1, nbytes + layer.nbytes
    gc.collect()
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    kv_caches = layer_views(engine.kv_cache)
    graphs, _ = capture_graphs(engine.config, device, model, None, engine.max_model_len, kv_caches)
    engine.runner.graphs = graphs
    capture_s = time.perf_counter() - t0
    return {
        "linears": swapped,
        "linear_gib": nbytes / 2**30,
        "graph_capture_s": capture_s,
        "cuda_graphs": graphs is not None,
    }


def time_batches(engine: Any, batches: list[int], context: int, steps: int) -> dict[str, Any]:
    from bench.gpu.engine import synthetic_prompts, timed_decode
    from llmserve.bench.engine_driver import Driver

    out: dict[str, Any] = {}
    for batch in batches:
        driver = Driver(engine)
        driver.start(synthetic_prompts(batch, context, engine.model_config.vocab_size))
        for _ in range(3):  # warm-up
            driver.decode()
        times = timed_decode(driver, steps)
        median = statistics.median(times)
        out[f"batch_{batch}"] = {"step_ms_median": median, "output_tok_s": batch / median * 1e3,
                                 "step_ms_min": min(times), "step_ms_max": max(times)}  # fmt: skip
    return out


def build_engine(args: argparse.Namespace, batches: list[int]) -> Any:
    from bench.gpu.engine import config_dir
    from llmserve.bench.engine_driver import blocks_needed
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    return Engine(
        EngineConfig(
            model=str(args.model_dir or config_dir(args.shape)),
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            num_kv_blocks=blocks_needed([args.input_len] * max(batches), args.decode_steps + 8, 16),
            max_num_seqs=max(batches),
            max_num_batched_tokens=args.input_len * max(batches),
            max_model_len=args.input_len + args.decode_steps + 64,
            attention_backend="cuda",
        )
    )


def table(result: dict[str, Any]) -> str:
    lines = [f"kept-weight decode, {result['shape']} (step ms median; x bf16)"]
    base = result.get("bf16", {})
    for fmt in ("bf16", *FORMATS):
        part = result.get(fmt, {})
        if "error" in part or not part:
            lines.append(f"  {fmt:>9}: {part.get('error', 'not run')}"[:160])
            continue
        cells = []
        for key, row in sorted(part.items()):
            if not key.startswith("batch_"):
                continue
            ratio = base.get(key, {}).get("step_ms_median", float("nan")) / row["step_ms_median"]
            cells.append(f"b{key[6:]} {row['step_ms_median']:.2f} ms (x{ratio:.2f})")
        lines.append(f"  {fmt:>9}: " + ", ".join(cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--model-dir", type=Path, default=None, help="instead of configs/SHAPE")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--formats", default=",".join(FORMATS), help=f"of {FORMATS}")
    args = p.parse_args()
    import torch

    batches = [int(b) for b in args.decode_batches.split(",")]
    result: dict[str, Any] = {"benchmark": "kept_decode", "shape": args.shape,
                              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "settings": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kept_decode_{args.shape}.json"
    engine = build_engine(args, batches)
    for fmt in ("bf16", *args.formats.split(",")):
        try:
            setup = {} if fmt == "bf16" else swap_projections(engine, fmt)
            result[fmt] = {
                **setup,
                **time_batches(engine, batches, args.input_len, args.decode_steps),
            }
        except Exception as err:  # one format failing must not lose the others
            result[fmt] = {"error": f"{type(err).__name__}: {err}"[:400]}
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"[{fmt}: {result[fmt]}]"[:300], flush=True)
    print(f"raw JSON: {path}\n{table(result)}")
    return 0 if all("error" not in result.get(f, {}) for f in ("bf16", *FORMATS)) else 1


if __name__ == "__main__":
    sys.exit(main())
