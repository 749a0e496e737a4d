"""Issue 15's cost of tensor parallelism on the CPU: one decode step of an engine group at
T = 1, 2, 3 (gloo, every rank a process of this machine), and the time its all-reduces take.

    python -m bench.studies.tp_cpu [--out bench/results/tp_cpu.json] [--steps 15]
        [--batches 1,16,64]
                           [--models builtin,wide,stack]

Two models: the built-in SmolLM2-135M (int8, 3 KV heads: T = 1 and 3 only) and a dummy
Llama of 12 heads / 6 KV heads (hidden 768, MLP 2304, 12 layers, float32: T = 1, 2, 3). Each
row: 128-token prompts prefilled, 3 warm-up decode steps, then --steps timed decode steps on
the driver (median). all_reduce_ms is the driver's time inside all-reduces per step (two a
layer and the embedding's: the transfer and the wait for the slowest rank), all_gather_ms the
LM head's, all_reduce_alone_us one all-reduce of the step's activations with nothing else
running (the transfer alone). Greedy tokens are recorded: a group that computes something else
than one engine shows.

`stack`: the whole stack (`llmserve serve`) on the built-in model at T = 1, T = 3 and P = 2, 16
concurrent streams of 128-token prompts and 64 output tokens (bench/studies/cpu_stack.py's client):
the output tokens/s a user sees, pipelining included (with P = 2 the scheduler keeps two steps of
different requests in flight, one per stage).

On a machine with fewer cores than ranks, the ranks share them (each gets cores / T threads, at
least one), so this measures what the split costs, not what more hardware would gain.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmserve.bench.engine_driver import time_decode_steps
from llmserve.bench.report import hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.parallel.groups import TPGroup
from llmserve.engine.parallel.ranks import run_group_locally

ROOT = Path(__file__).resolve().parents[2]

PROMPT_LEN = 128
WIDE = {  # a Llama shape that T = 1, 2 and 3 all split evenly
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 768,
    "intermediate_size": 2304,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 6,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


class _Timed:
    """Wraps a TPGroup's all_reduce and all_gather, summing the seconds spent in each."""

    def __init__(self, tp: TPGroup):
        self.seconds = {"all_reduce": 0.0, "all_gather": 0.0}
        self.calls = {"all_reduce": 0, "all_gather": 0}
        for name in self.seconds:
            setattr(tp, name, self._wrap(name, getattr(tp, name)))

    def _wrap(self, name: str, op: Any) -> Any:
        def timed(x: Any) -> Any:
            t0 = time.perf_counter()
            out = op(x)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out

        return timed

    def reset(self) -> None:
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0


def time_steps(engine: Any, parallel: Any, batches: list[int], steps: int) -> list[dict[str, Any]]:
    """On every rank: the decode steps of each batch size; the driver's timings (others: [])."""
    timed = _Timed(parallel.tp) if parallel is not None else None
    rows = []
    for batch in batches:
        warmed = timed.reset if timed is not None else None
        row = time_decode_steps(engine, batch, steps, PROMPT_LEN, warmed)
        if timed is not None:
            row["all_reduce_ms"] = round(timed.seconds["all_reduce"] * 1e3 / steps, 2)
            row["all_reduces_per_step"] = timed.calls["all_reduce"] // steps
            row["all_gather_ms"] = round(timed.seconds["all_gather"] * 1e3 / steps, 2)
            row["all_reduce_alone_us"] = all_reduce_alone_us(parallel, batch, engine)
        rows.append(row)
        engine.reset()
    return rows if parallel is None or parallel.topology.is_driver else []


def all_reduce_alone_us(parallel: Any, batch: int, engine: Any, repeats: int = 50) -> float:
    """Median microseconds of one all-reduce of a step's [batch, hidden] float32 activations
    with nothing else running: the wire and gloo's cost, without waiting for a slower rank."""
    x = torch.ones(batch, engine.model_config.hidden_size)
    for _ in range(5):
        dist.all_reduce(x, group=parallel.tp.group)
    times = []
    for _ in range(repeats):
        dist.barrier(group=parallel.tp.group)
        t0 = time.perf_counter()
        dist.all_reduce(x, group=parallel.tp.group)
        times.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(times), 1)


def run(config: EngineConfig, batches: list[int], steps: int) -> list[dict[str, Any]]:
    if config.tensor_parallel_size == 1:  # one engine, as `llmserve serve` runs it
        from llmserve.engine.step.engine import Engine

        return time_steps(Engine(config), None, batches, steps)
    work = functools.partial(time_steps, batches=batches, steps=steps)
    return run_group_locally(config, work, timeout=1800)[0]


STACK_GROUPS = {
    "T=1": [],
    "T=3": ["--tensor-parallel-size", "3"],
    "P=2": ["--pipeline-parallel-size", "2"],
}


def bench_stacks(max_tokens: int = 64, streams: int = 16) -> list[dict[str, Any]]:
    """Each STACK_GROUPS entry through `llmserve serve`: output tokens/s, TTFT, ITL."""
    from bench.studies.cpu_stack import bench_stack
    from llmserve.bench.workload import exact_length_prompt_ids
    from llmserve.common.model_config import builtin_model_path

    prompts, _ = exact_length_prompt_ids(builtin_model_path(), streams, PROMPT_LEN)
    rows = []
    for name, extra in STACK_GROUPS.items():
        result = bench_stack(prompts, max_tokens, 0, {"LLMSERVE_METRICS_PORT": "0"}, extra)
        rows.append({"group": name, "serve_args": extra, **result})
        print("stack", name, f"{result['output_tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def comm_bytes(hidden: int, vocab: int, tp: int, element: int) -> dict[str, float]:
    """Bytes each rank sends per token (ring all-reduce: 2 (T-1)/T of the tensor; all-gather:
    (T-1)/T of the whole), per layer and for the embeddings / LM head."""
    ring = 2 * (tp - 1) / tp
    return {
        "per_token_per_layer": 2 * ring * hidden * element,
        "embedding_per_token": ring * hidden * element,
        "lm_head_per_sampled_token": (tp - 1) / tp * vocab * 4,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tp_cpu.json")
    p.add_argument("--models", default="builtin,wide,stack", help="of builtin, wide, stack")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    wide_dir = Path(tempfile.mkdtemp(prefix="llmserve-wide-"))
    (wide_dir / "config.json").write_text(json.dumps(WIDE))
    runs = {
        "builtin": (None, "auto", [1, 3], 576, 49152),
        "wide": (str(wide_dir), "dummy", [1, 2, 3], WIDE["hidden_size"], WIDE["vocab_size"]),
    }
    results: list[dict[str, Any]] = []
    stack: list[dict[str, Any]] = []
    for name in args.models.split(","):
        if name == "stack":
            stack = bench_stacks()
            continue
        model, load_format, sizes, hidden, vocab = runs[name]
        for tp in sizes:
            config = EngineConfig(
                model=model, load_format=load_format, device="cpu", num_kv_blocks=1200, seed=0,
                tensor_parallel_size=tp,
            )  # fmt: skip
            rows = run(config, batches, args.steps)
            results.append({
                "model": name, "tensor_parallel_size": tp, "rows": rows,
                "comm_bytes": comm_bytes(hidden, vocab, tp, 4),
            })  # fmt: skip
            print(name, f"T={tp}", " ".join(
                f"b{r['batch']}={r['step_ms_median']}ms"
                + (f" (all-reduce {r['all_reduce_ms']}ms)" if "all_reduce_ms" in r else "")
                for r in rows
            ), flush=True)  # fmt: skip
    save(
        {
            "hardware": hardware(torch_threads=True),
            "steps": args.steps,
            "results": results,
            "stack": stack,
        },
        args.out,
    )
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
