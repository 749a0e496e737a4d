"""Issue 4's GPU benchmark: the engine on one GPU, real model shapes with dummy weights.

    python3 bench/gpu_engine.py --shape llama-3-8b   [--out DIR] [--skip-hf] ...
    python3 bench/gpu_engine.py --shape smollm2-135m [--out DIR]

For configs/<shape>/config.json with `--load-format dummy` (seeded random weights), bf16:

1. offline (the issue's workload): `llmserve bench offline` starts the whole stack (gateway,
   scheduler, engine; real gRPC) with `--device cuda`, sends --num-prompts requests of exactly
   512 prompt tokens (the byte-level tokenizer of a config-only model: 512 bytes) at once, each
   generating exactly 256 tokens (greedy, EOS ignored), and reports output tokens/s over the run.
   The engine records every step's span on the GPU (LLMSERVE_STEP_TIMELINE, engine/timeline.py);
   the GPU busy fraction is busy / wall over stretches of decode-only steps with >= 64 requests
   (idle = the gaps between steps, measured with CUDA events).
2. decode step time at batch 1 and 8 (an Engine in this process, CUDA graphs on, contexts of
   512 tokens): the median wall time of Engine.step over --decode-steps steps, against the floor
   of the bytes a decode step must read (every weight except an untied embedding table, of which
   only the batch's rows; plus the batch's KV) / 4.28 TB/s (../shared/gpu.md).
3. HF transformers: static `generate` on the same dummy weights (bf16, SDPA), one batch of
   --hf-batch requests of 512 prompt tokens generating --hf-output-len tokens each (a subset of
   the workload, sized to the time limit; said so in the output), and our offline throughput over
   HF's.

Writes DIR/gpu_engine_<shape>.json (the offline run's full bench document beside it) and prints
a table last. Nothing is downloaded; needs torch with CUDA, CuPy, transformers (for 3).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COPY_BYTES_PER_S = 4.28e12  # ../shared/gpu.md: device-to-device copy, bytes read + written
TARGETS: dict[str, dict[str, float]] = {
    # issue 4: output tok/s (offline), decode step / floor at batch 1 and 8, GPU busy in decode
    "llama-3-8b": {"output_tok_s": 12000.0, "decode_vs_floor": 1.4, "gpu_busy": 0.95},
    "smollm2-135m": {"output_tok_s": 50000.0, "gpu_busy": 0.85},
}


# A CPU dry run of this script (`--device cpu --dtype float32 --model-dir DIR`, a small
# config.json) checks its plumbing; the figures only mean something on the GPU.
MODEL_DIR: Path | None = None
DEVICE, DTYPE = "cuda", "bfloat16"


def config_dir(shape: str) -> Path:
    return MODEL_DIR or ROOT / "configs" / shape


# ---- 1. offline through the stack --------------------------------------------------------------


def serve_args(shape: str, args: argparse.Namespace) -> list[str]:
    return [
        "--device", DEVICE, "--dtype", DTYPE,
        "--model", str(config_dir(shape)), "--load-format", "dummy", "--seed", str(args.seed),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip


def run_offline(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    from engine.timeline import read_timeline, steady_decode_busy

    document_path = args.raw / f"gpu_engine_{shape}_offline.json"
    timeline_path = args.raw / f"gpu_engine_{shape}_steps.jsonl"
    timeline_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "llmserve.cli", "bench", "offline",
        "--dataset-name", "fixed", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--temperature", "0", "--ignore-eos", "--seed", str(args.seed),
        "--num-warmups", "1", "--no-progress", "--output", str(document_path),
        "--label", f"issue 4 offline, {shape}, dummy weights, bf16",
        "--", *serve_args(shape, args),
    ]  # fmt: skip
    env = dict(os.environ, LLMSERVE_STEP_TIMELINE=str(timeline_path))
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    try:
        returncode = proc.wait(timeout=args.offline_timeout_s)
    except subprocess.TimeoutExpired:
        # SIGINT, not a kill: `bench offline` then stops its stack (whose services run in
        # sessions of their own and would outlive it, holding the GPU).
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=45)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return {"error": f"timed out after {args.offline_timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    if returncode != 0 or not document_path.exists():
        return {"error": f"llmserve bench offline exited with {returncode}", "wall_s": wall}
    document = json.loads(document_path.read_text())
    run = document["runs"][0]
    metrics = run["metrics"]
    result: dict[str, Any] = {
        "command": cmd[2:],
        "wall_s_including_startup": round(wall, 1),
        "num_completed": metrics["num_completed"],
        "num_failed": metrics["num_failed"],
        "duration_s": metrics["duration_s"],
        "total_output_tokens": metrics["total_output_tokens"],
        "output_tok_s": metrics["output_throughput"],
        "total_tok_s": metrics["total_token_throughput"],
        "ttft_ms": metrics["ttft_ms"],
        "tpot_ms": metrics["tpot_ms"],
        "scheduler_stats": run.get("scheduler_stats", {}),
        "document": document_path.name,
    }
    if timeline_path.exists():
        records = read_timeline(str(timeline_path))
        busy = steady_decode_busy(records, min_seqs=args.busy_min_seqs)
        result["gpu_busy"] = {
            "min_seqs": args.busy_min_seqs,
            "num_stretches": busy.num_runs,
            "num_steps": busy.num_steps,
            "busy_ms": round(busy.busy_ms, 2),
            "wall_ms": round(busy.wall_ms, 2),
            "fraction": busy.busy_fraction,
            "mean_gap_ms": busy.mean_gap_ms,
            "steps_recorded": len(records),
            "timeline": timeline_path.name,
        }
    return result


# ---- 2. decode step time against the bandwidth floor --------------------------------------------


def decode_floor_bytes(shape: str, batch: int, context: int) -> dict[str, int]:
    """Bytes one decode step of `batch` requests at `context` tokens each must read, bf16."""
    from common.model_config import load_model_config
    from engine.dummy import hf_tensor_shapes

    config = load_model_config(config_dir(shape))
    shapes = hf_tensor_shapes(config)
    params = sum(math.prod(s) for s in shapes.values())
    embed = math.prod(shapes["model.embed_tokens.weight"])
    weights = params * 2
    if not config.tie_word_embeddings:  # a lookup of `batch` rows, not the whole table
        weights -= (embed - batch * config.hidden_size) * 2
    kv_per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 2
    return {"weights": weights, "kv": batch * context * kv_per_token}


def synthetic_prompts(num_prompts: int, num_tokens: int, vocab_size: int) -> list[list[int]]:
    """Fixed token ids, a different sequence for each prompt (the same for our engine and HF)."""
    return [
        [(i * 7919 + b * 104729) % vocab_size for i in range(num_tokens)]
        for b in range(num_prompts)
    ]


def decode_step_times(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine
    from llmserve.bench.engine_driver import Driver, blocks_needed

    batches = [int(b) for b in args.decode_batches.split(",")]
    context = args.input_len
    steps = args.decode_steps
    num_blocks = blocks_needed([context] * max(batches), steps + 8, 16)
    engine = Engine(
        EngineConfig(
            model=str(config_dir(shape)),
            load_format="dummy",
            seed=args.seed,
            device=DEVICE,
            dtype=DTYPE,
            num_kv_blocks=num_blocks,
            max_num_seqs=max(batches),
            max_num_batched_tokens=context * max(batches),
            max_model_len=args.max_model_len,
        )
    )
    vocab = engine.model_config.vocab_size
    results: dict[str, Any] = {
        "context_tokens": context,
        "steps_timed": steps,
        "cuda_graphs": engine.runner.graphs is not None,
        "ops": engine.model.ops.name,
    }
    for batch in batches:
        prompts = synthetic_prompts(batch, context, vocab)
        driver = Driver(engine)
        driver.start(prompts)
        for _ in range(5):  # warm-up
            driver.decode()
        times = []
        for _ in range(steps):
            if DEVICE == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            driver.decode()  # returns sampled ids on the host: the step is complete
            times.append((time.perf_counter() - t0) * 1e3)
        mean_context = context + 5 + steps / 2
        floor = decode_floor_bytes(shape, batch, int(mean_context))
        floor_ms = (floor["weights"] + floor["kv"]) / COPY_BYTES_PER_S * 1e3
        median = statistics.median(times)
        results[f"batch_{batch}"] = {
            "step_ms_median": median,
            "step_ms_p10": statistics.quantiles(times, n=10)[0],
            "step_ms_p90": statistics.quantiles(times, n=10)[-1],
            "floor_bytes": floor,
            "floor_ms": floor_ms,
            "vs_floor": median / floor_ms,
        }
    return results


# ---- 3. HF transformers -------------------------------------------------------------------------


def hf_generate(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from llmserve.bench.hf import dummy_model, timed_generate

    model = dummy_model(config_dir(shape), args.seed, getattr(torch, DTYPE), DEVICE)
    batch, out_len = args.hf_batch, args.hf_output_len
    prompts = synthetic_prompts(batch, args.input_len, model.config.vocab_size)
    timed_generate(model, [p[:64] for p in prompts[:2]], 4)  # warm-up
    seconds = timed_generate(model, prompts, out_len)
    return {
        "what": f"static generate, one batch of {batch} requests, {args.input_len} prompt tokens, "
        f"{out_len} new tokens each (a subset of the offline workload), {DTYPE}, SDPA",
        "batch": batch,
        "output_len": out_len,
        "seconds": seconds,
        "output_tok_s": batch * out_len / seconds,
    }


# ---- report ------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    for name in ("cupy", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    return info


def verdict(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    ok = value >= target if higher_is_better else value <= target
    return "meets" if ok else "misses"


def table(result: dict[str, Any]) -> str:
    shape, targets = result["shape"], TARGETS[result["shape"]]
    dtype = result.get("settings", {}).get("dtype", "bfloat16")
    rows = [f"== {shape}, {dtype}, dummy weights, {result['environment'].get('gpu', '?')}"]
    off = result.get("offline") or {}
    if "output_tok_s" in off:
        tok_s, target = off["output_tok_s"], targets["output_tok_s"]
        rows.append(
            f"offline {result['workload']}: {tok_s:,.0f} output tok/s "
            f"(target >= {target:,.0f}: {verdict(tok_s, target)}), "
            f"{off['num_completed']} completed, {off['num_failed']} failed, "
            f"{off['duration_s']:.1f} s"
        )
        busy = off.get("gpu_busy")
        if busy and busy["num_steps"]:
            rows.append(
                f"GPU busy in steady decode (>= {busy['min_seqs']} requests): "
                f"{busy['fraction']:.1%} over {busy['num_steps']} steps, mean gap "
                f"{busy['mean_gap_ms']:.2f} ms (target >= {targets['gpu_busy']:.0%}: "
                f"{verdict(busy['fraction'], targets['gpu_busy'])})"
            )
        else:
            rows.append("GPU busy in steady decode: no decode-only stretch recorded")
    elif off:
        rows.append(f"offline: {off.get('error')}")
    dec = result.get("decode") or {}
    for key, value in dec.items():
        if key.startswith("batch_"):
            line = (
                f"decode step, {key.replace('_', ' ')}, context {dec['context_tokens']}: "
                f"{value['step_ms_median']:.2f} ms vs floor {value['floor_ms']:.2f} ms = "
                f"{value['vs_floor']:.2f}x"
            )
            if "decode_vs_floor" in targets:
                target = targets["decode_vs_floor"]
                line += f" (target <= {target}x: {verdict(value['vs_floor'], target, False)})"
            rows.append(line)
    hf = result.get("hf") or {}
    if "output_tok_s" in hf:
        rows.append(f"HF transformers, {hf['what']}: {hf['output_tok_s']:,.0f} output tok/s")
        if "output_tok_s" in off:
            rows.append(
                f"ratio llmserve offline / HF: {off['output_tok_s'] / hf['output_tok_s']:.1f}x"
            )
    elif hf:
        rows.append(f"HF transformers: {hf.get('error')}")
    return "\n".join(rows)


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=sorted(TARGETS))
    p.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench" / "results")
    )
    p.add_argument(
        "--raw",
        type=Path,
        default=None,
        help="the offline run's document and step timeline (default: --out)",
    )
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--busy-min-seqs", type=int, default=64)
    p.add_argument("--offline-timeout-s", type=float, default=300)
    p.add_argument("--decode-batches", default="1,8")
    p.add_argument("--decode-steps", type=int, default=30)
    p.add_argument("--hf-batch", type=int, default=256)
    p.add_argument("--hf-output-len", type=int, default=64)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script's plumbing")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-dir", type=Path, default=None, help="instead of configs/SHAPE")
    args = p.parse_args()
    global MODEL_DIR, DEVICE, DTYPE
    MODEL_DIR, DEVICE, DTYPE = args.model_dir, args.device, args.dtype
    args.raw = args.raw or args.out
    for directory in (args.out, args.raw):
        directory.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "gpu_engine",
        "shape": args.shape,
        "environment": environment(),
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    parts = [
        ("offline", args.skip_offline, lambda: run_offline(args.shape, args)),
        ("decode", args.skip_decode, lambda: decode_step_times(args.shape, args)),
        ("hf", args.skip_hf, lambda: hf_generate(args.shape, args)),
    ]
    path = args.out / f"gpu_engine_{args.shape}.json"
    for name, skip, part in parts:
        if skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = part()
        except Exception as err:  # one part failing must not lose the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        gc.collect()  # no part's engine or model, failed or not, may hold the GPU for the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        # after every part, so a run stopped by a time limit keeps what it measured
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"raw JSON: {path}")
    print(table(result))
    return 0 if all("error" not in (result.get(n) or {}) for n, _, _ in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
