"""Issue 4's GPU benchmark: the engine on one GPU, real model shapes with dummy weights.

    python3 -m bench.gpu.engine --shape llama-3-8b   [--out DIR] [--skip-hf] ...
    python3 -m bench.gpu.engine --shape smollm2-135m [--out DIR]
    python3 -m bench.gpu.engine --shape llama-3-8b --quantization int8 --agreement \
        --skip-offline --skip-hf                                          (issue 14)

For configs/<shape>/config.json with `--load-format dummy` (seeded random weights), bf16 or
`--quantization int8|fp8` / `--kv-cache-dtype fp8` (passed to the engine in 1 and 2 and used by
4; recorded in the JSON, whose name then says the mode: gpu_engine_<shape>_int8.json):

1. offline (the issue's workload): `llmserve bench offline` starts the whole stack (gateway,
   scheduler, engine; real gRPC) with `--device cuda`, sends --num-prompts requests of exactly 512
   prompt tokens (the byte-level tokenizer of a config-only model: 512 bytes) at once, each
   generating exactly 256 tokens (greedy, EOS ignored), and reports output tokens/s over the run.
   The engine records every step's span on the GPU (LLMSERVE_STEP_TIMELINE,
   engine/step/timeline.py); the GPU busy fraction is busy / wall over stretches of decode-only
   steps with >= 64 requests (idle = the gaps between steps, measured with CUDA events).
2. decode step time at batch 1 and 8 (an Engine in this process, CUDA graphs on, contexts of
   512 tokens): the median wall time of Engine.step over --decode-steps steps, against the floor
   of the bytes a decode step must read (every weight except an untied embedding table, of which
   only the batch's rows; plus the batch's KV; int8 / fp8 weights and an fp8 pool at one byte an
   element) / 4.28 TB/s (docs/gpu.md#the-gpu-machine).
3. HF transformers: static `generate` on the same dummy weights (bf16, SDPA), one batch of
   --hf-batch requests of 512 prompt tokens generating --hf-output-len tokens each (a subset of
   the workload, sized to the time limit; said so in the output), and our offline throughput over
   HF's.
4. agreement (`--agreement`, issue 14): the quantized engine against the bf16 one on the same
   seeded random prompt tokens, teacher-forced (every prompt is fed to both, whatever they would
   have sampled): the first tokens of all prompts as one prefill step, the last
   --agreement-decode one per prompt per step (decode steps), each engine writing and reading
   its own KV pool (an fp8 pool is exercised by both attention kernels). Top-1 agreement of the
   next-token argmax and mean KL(bf16 || quantized) over every position. The two engines are
   built one after the other (one 8B model on the GPU at a time), eager, with a KV pool sized
   for the prompts. See AGREEMENT_NOTE on what random weights can and cannot say.

Writes DIR/gpu_engine_<shape>.json (the offline run's full bench document beside it) and prints
a table last. Nothing is downloaded; needs torch with CUDA, CuPy, transformers (for 3).
`quant_summary` / `quant_table` put the quantized runs beside the bf16 one
(bench/gpu_engine_check.sh).
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

ROOT = Path(__file__).resolve().parents[2]

# docs/gpu.md#the-gpu-machine: device-to-device copy, bytes read + written
COPY_BYTES_PER_S = 4.28e12
TARGETS: dict[str, dict[str, float]] = {
    # issue 4: output tok/s (offline), decode step / floor at batch 1 and 8, GPU busy in decode
    "llama-3-8b": {"output_tok_s": 12000.0, "decode_vs_floor": 1.4, "gpu_busy": 0.95},
    "smollm2-135m": {"output_tok_s": 50000.0, "gpu_busy": 0.85},
}
# Every shape configs/ holds (a config.json: the published shape, dummy weights here); the ones
# without TARGETS run for their figures alone (gpu_engine_check.sh's families stages).
SHAPES = sorted(p.parent.name for p in (ROOT / "configs").glob("*/config.json"))
AGREEMENT_NOTE = (
    "dummy (random) weights: no activation outliers, which are what costs a trained model its "
    "tokens under int8 / fp8, so on that account these figures are an upper bound of what a "
    "trained model keeps; but random weights also give near-flat next-token distributions "
    "(ref_top1_prob, ref_top1_margin_median), where any rounding flips the argmax more easily. "
    "They check the quantized paths end to end on the GPU, not a model's quality "
    "(tests/engine/model/test_quantization.py measures that on the built-in model, on the CPU)."
)


# A CPU dry run of this script (`--device cpu --dtype float32 --model-dir DIR`, a small
# config.json) checks its plumbing; the figures only mean something on the GPU.
MODEL_DIR: Path | None = None
DEVICE, DTYPE = "cuda", "bfloat16"
# Every engine here (offline stack, decode, agreement) runs with this --attention-backend: cuda on
# a GPU, so a kernel that fails to compile or its self-check stops the engine (issue 24) rather
# than leaving torch's figures labelled as the kernels'.
BACKEND = "cuda"


def config_dir(shape: str) -> Path:
    return MODEL_DIR or ROOT / "configs" / shape


def mode_label(quantization: str, kv_cache_dtype: str) -> str:
    """The run's mode in a word, empty for the model's own dtype throughout: e.g. "int8",
    "kv-fp8", "fp8_kv-fp8". It ends the JSON file's name, so letters, digits, '-' and '_'."""
    parts = [] if quantization in ("auto", "none") else [quantization]
    if kv_cache_dtype != "auto":
        parts.append(f"kv-{kv_cache_dtype}")
    return "_".join(parts)


def result_path(out: Path, shape: str, quantization: str, kv_cache_dtype: str) -> Path:
    label = mode_label(quantization, kv_cache_dtype)
    return out / f"gpu_engine_{shape}{'_' + label if label else ''}.json"


def free_device_memory() -> None:
    """Let go of what a dropped engine held, before the next is built."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- 1. offline through the stack --------------------------------------------------------------


def serve_args(shape: str, args: argparse.Namespace) -> list[str]:
    return [
        "--device", DEVICE, "--dtype", DTYPE,
        "--model", str(config_dir(shape)), "--load-format", "dummy", "--seed", str(args.seed),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--quantization", args.quantization, "--kv-cache-dtype", args.kv_cache_dtype,
        "--attention-backend", BACKEND,
    ]  # fmt: skip


def run_offline(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    from llmserve.engine.step.timeline import read_timeline, steady_decode_busy

    document_path = args.raw / f"gpu_engine_{shape}_offline.json"
    timeline_path = args.raw / f"gpu_engine_{shape}_steps.jsonl"
    timeline_path.unlink(missing_ok=True)
    cmd = [
        sys.executable, "-m", "llmserve.cli", "bench", "offline",
        "--dataset-name", "fixed", "--num-prompts", str(args.num_prompts),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--temperature", "0", "--ignore-eos", "--seed", str(args.seed),
        "--num-warmups", "1", "--no-progress", "--output", str(document_path),
        "--label", f"issue 4 offline, {shape}, dummy weights, "
        f"{mode_label(args.quantization, args.kv_cache_dtype) or DTYPE}",
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


def decode_floor_bytes(
    shape: str,
    batch: int,
    context: int,
    dtype_bytes: int = 2,
    linear_bytes: int | None = None,
    kv_bytes: int | None = None,
) -> dict[str, int]:
    """Bytes one decode step of `batch` requests at `context` tokens each must read: every
    weight, except that an untied embedding table is read only at the batch's rows and a
    mixture-of-experts layer's routed experts only where a token goes: with k of E experts per
    token, the expected number of distinct experts hit, E (1 - (1 - k / E) ** batch), if the
    router spread the tokens uniformly (the dummy weights' random routers come close; k at
    batch 1).

    dtype_bytes: per element of the model's dtype (bf16: 2); linear_bytes: per weight of the
    linear layers, the LM head included (--quantization int8 / fp8: 1; a tied head then reads a
    quantized copy of the table, the lookup the table's rows); kv_bytes: per KV element. Both
    default to dtype_bytes. Quantization scales and biases are counted as weights (< 0.1%).
    The KV: a sliding layer's window of the context, a full layer's whole context; K and V per
    KV head, or MLA's one latent row per token; none for a layer without KV (a Mamba-2 or gated
    DeltaNet layer). state: a hybrid model's recurrent state per request, read and written
    (each state layer's conv state in the model's dtype and fp32 SSM / delta-rule state).
    Granite's experts are stacked tensors (block_sparse_moe.input_linear / output_linear)."""
    from llmserve.common.model_config import load_model_config
    from llmserve.engine.model.dummy import hf_tensor_shapes

    linear_bytes = dtype_bytes if linear_bytes is None else linear_bytes
    kv_bytes = dtype_bytes if kv_bytes is None else kv_bytes
    config = load_model_config(config_dir(shape))
    shapes = hf_tensor_shapes(config)
    embed_name = "model.embed_tokens.weight"
    embed = math.prod(shapes[embed_name])
    norms = sum(math.prod(s) for n, s in shapes.items() if n.endswith("norm.weight"))
    stacked = (".block_sparse_moe.input_linear.", ".block_sparse_moe.output_linear.")
    experts = sum(
        math.prod(s) for n, s in shapes.items() if ".experts." in n or any(k in n for k in stacked)
    )
    linear = sum(
        math.prod(s) for n, s in shapes.items() if n != embed_name and not n.endswith("norm.weight")
    )
    if config.moe is not None:  # the experts' share that a step reads
        num, k = config.moe.num_experts, config.moe.top_k
        linear -= round(experts * (1 - (1 - (1 - k / num) ** batch)))
    weights = linear * linear_bytes + norms * dtype_bytes
    lookup = batch * config.hidden_size * dtype_bytes
    if not config.tie_word_embeddings:
        weights += lookup
    elif linear_bytes == dtype_bytes:  # the head reads the whole table, the lookup's rows too
        weights += embed * dtype_bytes
    else:
        weights += embed * linear_bytes + lookup
    kv = 0
    for layer in range(config.num_layers):  # a sliding layer reads its window's keys alone
        if config.kv_layer_index(layer + 1) == config.kv_layer_index(layer):
            continue  # no KV: a state layer, Nemotron-H's MLP / MoE block
        window = config.layer_window(layer)
        seen = context if window is None else min(context, window)
        if config.mla is not None:  # one latent row per token: K and V are the same slot
            kv += seen * config.mla.latent_dim * kv_bytes
        else:
            kv += seen * 2 * config.num_kv_heads * config.head_dim * kv_bytes
    state, layout = 0, config.state_layout  # engine/kv/state.py's pool: fp32 SSM state
    if layout is not None:
        per_layer = (
            math.prod(layout.conv_shape) * dtype_bytes + math.prod(layout.recurrent_shape) * 4
        )
        state = 2 * batch * config.num_state_layers * per_layer  # read and written back
    return {"weights": weights, "kv": batch * kv, "state": state}


def synthetic_prompts(num_prompts: int, num_tokens: int, vocab_size: int) -> list[list[int]]:
    """Fixed token ids, a different sequence for each prompt (the same for our engine and HF)."""
    return [
        [(i * 7919 + b * 104729) % vocab_size for i in range(num_tokens)]
        for b in range(num_prompts)
    ]


def decode_step_times(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from llmserve.bench.engine_driver import Driver, blocks_needed
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

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
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            attention_backend=BACKEND,
        )
    )
    vocab = engine.model_config.vocab_size
    dtype_bytes = torch.empty(0, dtype=engine.dtype).element_size()
    linear_bytes = 1 if engine.quantization in ("int8", "fp8") else dtype_bytes
    kv_bytes = torch.empty(0, dtype=engine.kv_dtype).element_size()
    results: dict[str, Any] = {
        "context_tokens": context,
        "steps_timed": steps,
        "cuda_graphs": engine.runner.graphs is not None,
        "ops": engine.model.ops.name,
        "ops_reason": engine.ops_reason,
        "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
    }
    for batch in batches:
        prompts = synthetic_prompts(batch, context, vocab)
        driver = Driver(engine)
        driver.start(prompts)
        for _ in range(5):  # warm-up
            driver.decode()
        times = timed_decode(driver, steps)
        eager: list[float] = []
        if args.eager_decode and engine.runner.graphs is not None:
            graphs, engine.runner.graphs = engine.runner.graphs, None  # the same engine, eager
            try:
                eager = timed_decode(driver, steps)
            finally:
                engine.runner.graphs = graphs
        mean_context = context + 5 + steps / 2
        floor = decode_floor_bytes(
            shape, batch, int(mean_context), dtype_bytes, linear_bytes, kv_bytes
        )
        floor_ms = sum(floor.values()) / COPY_BYTES_PER_S * 1e3
        median = statistics.median(times)
        results[f"batch_{batch}"] = {
            "step_ms_median": median,
            "output_tok_s": batch / median * 1e3,
            "step_ms_p10": statistics.quantiles(times, n=10)[0],
            "step_ms_p90": statistics.quantiles(times, n=10)[-1],
            "floor_bytes": floor,
            "floor_ms": floor_ms,
            "vs_floor": median / floor_ms,
        }
        if eager:
            eager_ms = statistics.median(eager)
            results[f"batch_{batch}"]["eager_step_ms_median"] = eager_ms
            results[f"batch_{batch}"]["graph_speedup"] = eager_ms / median
    return results


def timed_decode(driver: Any, steps: int) -> list[float]:
    """Wall ms of each of `steps` decode steps (each returns its sampled ids on the host, so
    the step is complete)."""
    import torch

    times = []
    for _ in range(steps):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        driver.decode()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


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


# ---- 4. top-1 agreement of a quantized engine with the bf16 one (issue 14) ---------------------


def agreement_prompts(
    num_prompts: int, num_tokens: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """Seeded random token ids: the same for every engine compared."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids: list[list[int]] = torch.randint(
        0, vocab_size, (num_prompts, num_tokens), generator=gen
    ).tolist()
    return ids


def teacher_forced_logits(engine: Any, prompts: list[list[int]], num_decode: int) -> list[Any]:
    """Float32 logits [len(prompt), vocab] at every position of each prompt, through
    engine.model and the engine's own KV pool (blocks handed out in order from 0, as
    llmserve.bench.engine_driver.Driver does): all prompts but their last num_decode tokens as
    one prefill step, then those one token per prompt per step, as decode steps. Each step
    stores its K/V in the pool and attends over what the pool holds, so an fp8 pool is written
    and read back by both attention paths. Needs sum(ceil(len / block_size)) <= num_blocks."""
    import torch

    from llmserve.engine.model.ops import AttentionContext

    bs = engine.config.block_size
    lengths = [len(p) for p in prompts]
    prefill = [n - num_decode for n in lengths]
    if min(prefill) < 1:
        raise ValueError(
            f"prompts of {min(lengths)} tokens leave no prefill before {num_decode} decodes"
        )
    tables: list[list[int]] = []
    for n in lengths:
        first = sum(len(t) for t in tables)
        tables.append(list(range(first, first + -(-n // bs))))
    needed = sum(len(t) for t in tables)
    if needed > engine.num_blocks:
        raise ValueError(f"the prompts need {needed} KV blocks; the pool has {engine.num_blocks}")

    def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=engine.device)

    def forward(starts: list[int], ends: list[int]) -> list[torch.Tensor]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        for prompt, table, start, end in zip(prompts, tables, starts, ends, strict=True):
            ids += prompt[start:end]
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            cu_seqlens_q.append(cu_seqlens_q[-1] + end - start)
        width = max(-(-end // bs) for end in ends)
        block_tables = tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables])
        ctx = AttentionContext(
            tensor(slots), block_tables, list(ends), cu_seqlens_q, engine.runner.kv_caches
        )
        hidden = engine.model(tensor(ids), tensor(positions), ctx)
        logits = engine.model.compute_logits(hidden).float()
        return list(logits.split([e - s for s, e in zip(starts, ends, strict=True)]))

    with torch.inference_mode():
        pieces = [[chunk] for chunk in forward([0] * len(prompts), prefill)]
        for step in range(num_decode):
            for piece, row in zip(
                pieces,
                forward([n + step for n in prefill], [n + step + 1 for n in prefill]),
                strict=True,
            ):
                piece.append(row)
        return [torch.cat(piece) for piece in pieces]


def compare_logits(reference: list[Any], other: list[Any], num_decode: int) -> dict[str, Any]:
    """Top-1 agreement and mean KL(reference || other) in nats over every position, and apart
    for the prefill positions and the last num_decode (decode) positions of each prompt; how
    peaked the reference is (mean top-1 probability, median top-1 - top-2 logit gap)."""
    import torch

    sums = {"prefill": [0, 0.0, 0], "decode": [0, 0.0, 0]}  # same, kl, positions
    top1_prob = 0.0
    margins: list[torch.Tensor] = []
    for ref, got in zip(reference, other, strict=True):
        ref_log, got_log = ref.log_softmax(-1), got.log_softmax(-1)
        same = ref.argmax(-1) == got.argmax(-1)
        kl = (ref_log.exp() * (ref_log - got_log)).sum(-1)
        split = ref.shape[0] - num_decode
        for phase, rows in (("prefill", slice(0, split)), ("decode", slice(split, None))):
            sums[phase][0] += int(same[rows].sum())
            sums[phase][1] += float(kl[rows].sum())
            sums[phase][2] += int(same[rows].numel())
        top1_prob += float(ref_log.max(-1).values.exp().sum())
        top2 = ref.topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).cpu())
    same_all = sum(v[0] for v in sums.values())
    kl_all = sum(v[1] for v in sums.values())
    n = sum(v[2] for v in sums.values())
    return {
        "top1": same_all / n,
        "mean_kl": kl_all / n,
        "positions": n,
        "by_phase": {
            phase: {"top1": v[0] / v[2], "mean_kl": v[1] / v[2], "positions": v[2]}
            for phase, v in sums.items()
            if v[2]
        },
        "ref_top1_prob": top1_prob / n,
        "ref_top1_margin_median": float(torch.cat(margins).median()),
    }


def quality_engine(
    shape: str, args: argparse.Namespace, quantization: str, kv_cache_dtype: str, num_blocks: int
) -> Any:
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    return Engine(
        EngineConfig(
            model=str(config_dir(shape)),
            load_format="dummy",
            seed=args.seed,
            device=DEVICE,
            dtype=DTYPE,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            num_kv_blocks=num_blocks,
            max_num_seqs=args.agreement_prompts,
            max_num_batched_tokens=args.agreement_prompts * args.agreement_len,
            max_model_len=args.max_model_len,
            attention_backend=BACKEND,
            enforce_eager=True,  # no CUDA graphs to capture: forwards of any shape, eagerly
        )
    )


def agreement(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    """The engine of --quantization / --kv-cache-dtype against the unquantized one (bf16 on a
    GPU), teacher-forced on the same seeded random prompts; one engine on the device at a time
    (the quantized one's logits are kept while the reference is built)."""
    from llmserve.bench.engine_driver import blocks_needed
    from llmserve.common.model_config import load_model_config

    vocab = load_model_config(config_dir(shape)).vocab_size
    num, length, num_decode = args.agreement_prompts, args.agreement_len, args.agreement_decode
    prompts = agreement_prompts(num, length, vocab, args.seed + 1)
    num_blocks = blocks_needed([length] * num, 0, 16)
    t0 = time.perf_counter()
    engine = quality_engine(shape, args, args.quantization, args.kv_cache_dtype, num_blocks)
    mode = {
        "quantization": engine.quantization,
        "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
        "ops": engine.model.ops.name,
        "ops_reason": engine.ops_reason,
    }
    other = teacher_forced_logits(engine, prompts, num_decode)
    del engine
    free_device_memory()
    reference_engine = quality_engine(shape, args, "none", "auto", num_blocks)
    reference_dtype = str(reference_engine.kv_dtype).removeprefix("torch.")
    reference = teacher_forced_logits(reference_engine, prompts, num_decode)
    del reference_engine
    free_device_memory()
    figures = compare_logits(reference, other, num_decode)
    return {
        "what": f"teacher-forced, {num} seeded random prompts of {length} tokens: the first "
        f"{length - num_decode} as one prefill step, the last {num_decode} as decode steps; "
        f"KL(reference || quantized) in nats",
        **mode,
        "reference": {"quantization": "none", "dtype": reference_dtype},
        **figures,
        "seconds": round(time.perf_counter() - t0, 1),
        "note": AGREEMENT_NOTE,
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
    shape, targets = result["shape"], TARGETS.get(result["shape"], {})
    settings = result.get("settings", {})
    dtype = settings.get("dtype", "bfloat16")
    label = mode_label(settings.get("quantization", "auto"), settings.get("kv_cache_dtype", "auto"))
    mode = f"{dtype}, {label}" if label else dtype
    rows = [f"== {shape}, {mode}, dummy weights, {result['environment'].get('gpu', '?')}"]
    off = result.get("offline") or {}
    if "output_tok_s" in off:
        tok_s, target = off["output_tok_s"], targets.get("output_tok_s", 0.0)
        rows.append(
            f"offline {result['workload']}: {tok_s:,.0f} output tok/s "
            f"(target >= {target:,.0f}: {verdict(tok_s, target)}), "
            f"{off['num_completed']} completed, {off['num_failed']} failed, "
            f"{off['duration_s']:.1f} s"
        )
        busy = off.get("gpu_busy")
        if busy and busy["num_steps"] and "gpu_busy" in targets:
            rows.append(
                f"GPU busy in steady decode (>= {busy['min_seqs']} requests): "
                f"{busy['fraction']:.1%} over {busy['num_steps']} steps, mean gap "
                f"{busy['mean_gap_ms']:.2f} ms (target >= {targets.get('gpu_busy', 0):.0%}: "
                f"{verdict(busy['fraction'], targets.get('gpu_busy', 0.0))})"
            )
        else:
            rows.append("GPU busy in steady decode: no decode-only stretch recorded")
    elif off and "output_tok_s" not in off:
        rows.append(f"offline: {off.get('error')}")
    dec = result.get("decode") or {}
    for key, value in dec.items():
        if key.startswith("batch_"):
            line = (
                f"decode step, {key.replace('_', ' ')}, context {dec['context_tokens']}: "
                f"{value['step_ms_median']:.2f} ms vs floor {value['floor_ms']:.2f} ms = "
                f"{value['vs_floor']:.2f}x"
            )
            if "decode_vs_floor" in targets and not label:  # issue 4's targets: bf16
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
    agree = result.get("agreement") or {}
    if "top1" in agree:
        rows.append(f"vs {agree['reference']['dtype']}: {agreement_line(agree)}")
    elif agree:
        rows.append(f"agreement: {agree.get('error')}")
    return "\n".join(rows)


def agreement_line(agree: dict[str, Any]) -> str:
    phases = ", ".join(f"{phase} {v['top1']:.1%}" for phase, v in agree.get("by_phase", {}).items())
    return (
        f"top-1 {agree['top1']:.2%} ({phases}), mean KL {agree['mean_kl']:.2e} nats over "
        f"{agree['positions']} positions (reference top-1 prob {agree['ref_top1_prob']:.3f})"
    )


# ---- the quantized runs beside the bf16 one (bench/gpu_engine_check.sh) -------------------------


def load_result(path: Path) -> dict[str, Any] | None:
    try:
        result: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result


def decode_batches(result: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """{"batch_1": figures, ...} of a result's decode part ({} when it has none)."""
    decode = (result or {}).get("decode") or {}
    return {k: v for k, v in decode.items() if k.startswith("batch_")}


def quant_summary(baselines: list[Path], runs: list[Path]) -> dict[str, Any]:
    """One document for the quantized runs: the bf16 baseline (the first of `baselines` with
    decode figures and no quantization), then each run of `runs` (gpu_engine.py JSON files, a
    bf16 one among them is a baseline too) with its decode tok/s against the baseline's at the
    same batch and its agreement figures."""
    results = [(p, r) for p in runs if (r := load_result(p)) is not None]
    baseline_path, baseline = None, None
    for path, result in [(p, load_result(p)) for p in baselines] + results:
        settings = (result or {}).get("settings", {})
        label = mode_label(
            settings.get("quantization", "auto"), settings.get("kv_cache_dtype", "auto")
        )
        if result is not None and not label and decode_batches(result):
            baseline_path, baseline = path, result
            break
    base = decode_batches(baseline)
    modes: dict[str, Any] = {}
    for path, result in results:
        settings = result.get("settings", {})
        label = mode_label(
            settings.get("quantization", "auto"), settings.get("kv_cache_dtype", "auto")
        )
        if not label:
            continue
        decode = {}
        for key, figures in decode_batches(result).items():
            row = {
                "step_ms": figures["step_ms_median"],
                "output_tok_s": figures.get("output_tok_s"),
            }
            if key in base:
                row["bf16_step_ms"] = base[key]["step_ms_median"]
                row["tok_s_vs_bf16"] = base[key]["step_ms_median"] / figures["step_ms_median"]
            decode[key] = row
        modes[label] = {
            "file": path.name,
            "decode": decode,
            "decode_error": (result.get("decode") or {}).get("error"),
            "agreement": result.get("agreement"),
        }
    return {
        "benchmark": "gpu_engine_quant",
        "shape": (baseline or (results[0][1] if results else {})).get("shape"),
        "environment": (baseline or (results[0][1] if results else {})).get("environment"),
        "baseline": None
        if baseline is None
        else {"file": str(baseline_path), "decode": decode_batches(baseline)},
        "modes": modes,
        "note": AGREEMENT_NOTE,
    }


def quant_table(summary: dict[str, Any]) -> str:
    base = (summary.get("baseline") or {}).get("decode") or {}
    rows = [
        f"== {summary.get('shape')}: quantized modes vs bf16, dummy weights (decode: median step "
        f"time, tok/s = batch / step; agreement: teacher-forced, random weights, see the note)"
    ]

    def decode_cells(decode: dict[str, Any]) -> str:
        cells = []
        for key, row in decode.items():
            ms = row.get("step_ms", row.get("step_ms_median"))
            batch = int(key.removeprefix("batch_"))
            cell = f"b{batch} {ms:.2f} ms = {batch / ms * 1e3:,.0f} tok/s"
            if "tok_s_vs_bf16" in row:
                cell += f" ({row['tok_s_vs_bf16']:.2f}x)"
            cells.append(cell)
        return " | ".join(cells)

    rows.append(f"{'bf16':<10} {decode_cells(base) if base else 'no decode baseline measured'}")
    for label, mode in summary.get("modes", {}).items():
        line = f"{label:<10} "
        line += (
            decode_cells(mode["decode"]) if mode["decode"] else f"decode: {mode['decode_error']}"
        )
        agree = mode.get("agreement") or {}
        if "top1" in agree:
            line += f" | top-1 {agree['top1']:.2%}, KL {agree['mean_kl']:.2e}"
        elif agree:
            line += f" | agreement: {agree.get('error')}"
        rows.append(line)
    rows.append(f"note: {summary.get('note', AGREEMENT_NOTE)}")
    return "\n".join(rows)


def main() -> int:
    from llmserve.engine.config import KV_CACHE_DTYPES, QUANTIZATIONS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=SHAPES)
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
    p.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="the engine's (offline, decode, agreement); auto = none for a dummy config",
    )
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument(
        "--agreement",
        action="store_true",
        help="part 4: top-1 agreement and KL of this mode against the unquantized engine",
    )
    p.add_argument("--agreement-prompts", type=int, default=16)
    p.add_argument("--agreement-len", type=int, default=256)
    p.add_argument(
        "--agreement-decode",
        type=int,
        default=16,
        help="of each prompt's positions, run as decodes",
    )
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument(
        "--eager-decode",
        action="store_true",
        help="part 2 also times each batch's decode without its CUDA graph (graph vs eager)",
    )
    p.add_argument(
        "--attention-backend",
        choices=("cuda", "auto", "torch"),
        default=None,
        help="every engine's (default: cuda with --device cuda, so a failing kernel is an "
        "error, never a silent fallback to torch; auto elsewhere)",
    )
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script's plumbing")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--model-dir", type=Path, default=None, help="instead of configs/SHAPE")
    args = p.parse_args()
    global MODEL_DIR, DEVICE, DTYPE, BACKEND
    MODEL_DIR, DEVICE, DTYPE = args.model_dir, args.device, args.dtype
    BACKEND = args.attention_backend or ("cuda" if DEVICE == "cuda" else "auto")
    args.raw = args.raw or args.out
    for directory in (args.out, args.raw):
        directory.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "gpu_engine",
        "shape": args.shape,
        "environment": environment(),
        "workload": f"{args.num_prompts} x {args.input_len} in / {args.output_len} out",
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "attention_backend": BACKEND
        + (": the engines refuse to start without the CUDA kernels" if BACKEND == "cuda" else ""),
    }
    parts = [
        ("offline", args.skip_offline, lambda: run_offline(args.shape, args)),
        ("decode", args.skip_decode, lambda: decode_step_times(args.shape, args)),
        ("hf", args.skip_hf, lambda: hf_generate(args.shape, args)),
        ("agreement", not args.agreement, lambda: agreement(args.shape, args)),
    ]
    path = result_path(args.out, args.shape, args.quantization, args.kv_cache_dtype)
    for name, skip, part in parts:
        if skip:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = part()
        except Exception as err:  # one part failing must not lose the others
            result[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"[{name} FAILED: {result[name]['error']}]", flush=True)  # for the check's log
        free_device_memory()  # no part's engine or model, failed or not, may hold the GPU
        print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
        # after every part, so a run stopped by a time limit keeps what it measured
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"raw JSON: {path}")
    print(table(result))
    return 0 if all("error" not in (result.get(n) or {}) for n, _, _ in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
