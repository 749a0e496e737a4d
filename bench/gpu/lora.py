"""Issue 28's GPU check: batched LoRA on a real shape (Llama-3-8B), 8 distinct adapters at once.

    python3 -m bench.gpu.lora --shape llama-3-8b [--out DIR] [--adapters 8] [--rank 16]
        [--decode-batches 8,64] [--decode-steps 15]

An Engine in this process: configs/<shape> with `--load-format dummy` (seeded random weights), bf16,
`--attention-backend cuda`, `--max-loras N`, whose start runs kernels/lora.cu's self-check
(engine/features/adapters.py). N rank-R adapters of all seven projections (q, k, v, o, gate, up,
down) with random A and B are made here, in memory (no file, nothing downloaded), and put in the
engine's host cache as checked adapters; the first step places them in the device slots.

For each batch size, on the same engine and prompts (--input-len tokens each), one after the
other:
- `base`: no adapters, the engine's usual decode (CUDA graphs);
- `base_eager`: no adapters, graphs off: decode steps with adapters run eager (they skip the
  graphs), so this separates the adapters' own cost from the graphs';
- `lora`: request i under adapter i mod N (every adapter in every step).

Per configuration: the prefill step (every prompt at once: long segments, torch's matmuls per
segment), the median decode step (kernels/lora.cu), output tokens/s, and for `lora` its ratios
to `base` and `base_eager`, the lora_add launches per decode step (4 per layer expected) and
whether the adapters changed the tokens. Writes OUT/gpu_lora_<shape>.json after every
measurement (a run stopped by a time limit keeps what it measured) and prints a table last.
`--device cpu --dtype float32 --model-dir DIR` runs the plumbing on a small config.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapters(engine: Any, num: int, rank: int, seed: int) -> list[str]:
    """num random rank-`rank` adapters of every layer's seven projections in the engine's host
    cache (float32 on the host, as engine/features/lora_files.py keeps a checked one); their
    names."""
    import torch

    from llmserve.engine.features.lora_files import LoraAdapter, module_shapes

    config = engine.model_config
    shapes = module_shapes(config)
    device = engine.device
    gen = torch.Generator(device=device).manual_seed(seed)
    names = []
    for k in range(num):
        weights = {}
        for layer in range(config.num_layers):
            for module in TARGETS:
                out_features, in_features = shapes[module]
                a = torch.randn(rank, in_features, generator=gen, device=device)
                b = torch.randn(out_features, rank, generator=gen, device=device)
                weights[(layer, module)] = ((a * in_features**-0.5).cpu(), (b * 0.02).cpu())
        name = f"dummy-{k}"
        engine.adapters.cache[name] = LoraAdapter(name, "", rank, 1.0, TARGETS, weights)
        names.append(name)
    return names


def counting_lora_kernel() -> list[int]:
    """Count kernels.cuda.lora_add's calls (KernelOps looks it up at each call): [count]."""
    import llmserve.kernels.cuda as kc

    calls = [0]
    original = kc.lora_add

    def counted(*args: Any, **named: Any) -> Any:
        calls[0] += 1
        return original(*args, **named)

    kc.lora_add = counted
    return calls


def measure(
    engine: Any, prompts: list[list[int]], slots: list[int] | None, loads: list, steps: int
) -> dict[str, Any]:
    """Prefill every prompt in one step, 3 warm-up decodes, then `steps` timed decode steps."""
    import torch

    from llmserve.bench.engine_driver import Driver

    def sync() -> None:
        if engine.device.type == "cuda":
            torch.cuda.synchronize()

    driver = Driver(engine)
    sync()
    t0 = time.perf_counter()
    driver.start(prompts, slots, loads)
    sync()
    prefill_ms = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        driver.decode()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        driver.decode()
        times.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(times)
    return {
        "prefill_ms": round(prefill_ms, 2),
        "step_ms_median": round(median, 3),
        "step_ms_p10": round(statistics.quantiles(times, n=10)[0], 3),
        "step_ms_p90": round(statistics.quantiles(times, n=10)[-1], 3),
        "output_tok_s": round(len(prompts) / median * 1e3, 1),
        "tokens": [g[:8] for g in driver.generated],
    }


def run_batch(
    engine: Any, batch: int, names: list[str], args: argparse.Namespace, calls: list[int]
) -> dict[str, Any]:
    """base, base_eager and lora for one batch size (see the module docstring)."""
    from llmserve.common.step_plan import LoraLoad

    vocab = engine.model_config.vocab_size
    prompts = [
        [(7919 * (i + 1) + 31 * j) % (vocab - 10) + 5 for j in range(args.input_len)]
        for i in range(batch)
    ]
    slots = [i % len(names) + 1 for i in range(batch)]
    loads = [LoraLoad(k + 1, name) for k, name in enumerate(names)]
    row: dict[str, Any] = {"base": measure(engine, prompts, None, [], args.decode_steps)}
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        row["base_eager"] = measure(engine, prompts, None, [], args.decode_steps)
        before = calls[0]
        row["lora"] = measure(engine, prompts, slots, loads, args.decode_steps)
        decodes = 3 + args.decode_steps
    finally:
        engine.runner.graphs = graphs
    lora = row["lora"]
    lora["lora_add_launches_per_decode_step"] = (calls[0] - before) / decodes
    lora["requests_whose_tokens_changed"] = sum(
        a != b for a, b in zip(lora["tokens"], row["base_eager"]["tokens"], strict=True)
    )
    for name in ("base", "base_eager"):
        row[f"lora_vs_{name}"] = round(lora["output_tok_s"] / row[name]["output_tok_s"], 3)
        row[f"lora_prefill_vs_{name}"] = round(row[name]["prefill_ms"] / lora["prefill_ms"], 3)
    for config in ("base", "base_eager", "lora"):
        row[config]["tokens"] = row[config]["tokens"][:2]  # enough to compare by eye
    return row


def table(result: dict[str, Any]) -> str:
    rows = [f"== LoRA on {result['shape']}: {result['adapters']} adapters of rank {result['rank']}"]
    for key, row in result.items():
        if key.startswith("batch_") and "lora" in row:
            rows.append(
                f"{key}: decode ms base {row['base']['step_ms_median']} / eager "
                f"{row['base_eager']['step_ms_median']} / lora {row['lora']['step_ms_median']}"
                f" -> lora {row['lora_vs_base']}x base tok/s ({row['lora_vs_base_eager']}x "
                f"eager); prefill {row['lora_prefill_vs_base']}x; "
                f"{row['lora']['lora_add_launches_per_decode_step']:.0f} kernel launches/step"
            )
        elif key.startswith("batch_"):
            rows.append(f"{key}: {row}")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    )
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--decode-batches", default="8,64")
    p.add_argument("--decode-steps", type=int, default=15)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the plumbing")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-dir", type=Path, default=None, help="instead of configs/SHAPE")
    args = p.parse_args()
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    batches = [int(b) for b in args.decode_batches.split(",")]
    context = args.input_len + args.decode_steps + 8
    config = EngineConfig(
        model=str(args.model_dir or ROOT / "configs" / args.shape),
        load_format="dummy", seed=args.seed, device=args.device, dtype=args.dtype,
        num_kv_blocks=max(batches) * -(-context // 16), max_num_seqs=max(batches),
        max_num_batched_tokens=args.input_len * max(batches), max_model_len=context + 16,
        attention_backend="cuda" if args.device == "cuda" else "auto",
        max_loras=args.adapters, max_lora_rank=args.rank, max_cpu_loras=args.adapters,
    )  # fmt: skip
    engine = Engine(config)
    calls = counting_lora_kernel()
    t0 = time.perf_counter()
    names = make_adapters(engine, args.adapters, args.rank, args.seed)
    result: dict[str, Any] = {
        "benchmark": "gpu_lora",
        "shape": args.shape,
        "adapters": args.adapters,
        "rank": args.rank,
        "target_modules": list(TARGETS),
        "input_len": args.input_len,
        "decode_steps": args.decode_steps,
        "ops": engine.model.ops.name,
        "cuda_graphs": engine.runner.graphs is not None,
        "adapters_made_s": round(time.perf_counter() - t0, 2),
        "device": args.device,
    }
    path = args.out / f"gpu_lora_{args.shape}.json"
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for batch in batches:
        try:
            result[f"batch_{batch}"] = run_batch(engine, batch, names, args, calls)
        except Exception as err:  # one batch failing must not lose the others
            result[f"batch_{batch}"] = {"error": f"{type(err).__name__}: {err}"}
            print(f"[batch {batch} FAILED: {result[f'batch_{batch}']['error']}]", flush=True)
            failed = True
        path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"raw JSON: {path}")
    print(table(result))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
