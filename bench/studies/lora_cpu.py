"""Issue 28's CPU figure: what batched LoRA costs. The built-in model in-process (the engine's
step loop, no gRPC), 16 requests at once, 128-token prompts, 128 output tokens each, greedy;
output tokens per second with 0 (the base alone), 1, 4 and 16 distinct rank-16 adapters in the
batch (request i under adapter i mod k). Configurations alternate within each round, so a
change in the machine's load hits all of them alike; the figure per configuration is the
median over rounds, and each ratio is to the base in the same round. Each batch's wall time
and this process's CPU time are both recorded: with one torch thread (--num-threads 1) on a
machine others share, tokens per CPU second is the steadier figure (the wall clock also counts
the time the scheduler gave the core to other processes).

Two adapter shapes: q_proj + v_proj (PEFT's default target modules for Llama) and all seven
projections (q, k, v, o, gate, up, down), which adds about as many weights per adapter as
three quarters of a base layer's. Adapters are written in PEFT's format (adapter_config.json +
adapter_model.safetensors) with random A and B; they load through the engine's checks.

    python -m bench.studies.lora_cpu [--rounds 2] [--out bench/results/lora_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.bench.engine_driver import GREEDY
from llmserve.bench.report import hardware, save
from llmserve.common.model_config import builtin_model_path, load_model_config
from llmserve.common.step_plan import LoraLoad, NewRequest, RunningColumns, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.features.lora_files import module_shapes
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS, PROMPT_LEN, RANK = 16, 128, 16
BLOCK_SIZE = 16
TARGETS = {
    "qv": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def write_adapter(directory: Path, targets: list[str], seed: int) -> Path:
    """A rank-RANK PEFT adapter of the built-in model's shape, random A and B."""
    config = load_model_config(builtin_model_path())
    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, RANK, generator=generator) * 0.01
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": targets}
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def run_batch(
    engine: Engine, names: list[str], step_id: int, output_len: int
) -> tuple[float, float, int, list[int]]:
    """One batch of NUM_REQUESTS requests, request i under names[i % len(names)] (none: the
    base); (wall seconds, this process's CPU seconds, the next free step id, request 0's first
    tokens)."""
    engine.reset()
    slots = {name: k + 1 for k, name in enumerate(names)}
    loads = [LoraLoad(slot, name) for name, slot in slots.items()]
    row_slots = [slots[names[i % len(names)]] if names else 0 for i in range(NUM_REQUESTS)]
    rng = random.Random(0)
    per_seq = -(-(PROMPT_LEN + 128) // BLOCK_SIZE)
    new = [
        NewRequest(
            i + 1, [rng.randrange(100, 40000) for _ in range(PROMPT_LEN)], PROMPT_LEN, GREEDY,
            list(range(i * per_seq, (i + 1) * per_seq)), 0, PROMPT_LEN, row_slots[i],
        )
        for i in range(NUM_REQUESTS)
    ]  # fmt: skip
    first: list[int] = []
    t0, cpu0 = time.perf_counter(), time.process_time()
    out = engine.step(StepPlanData(step_id, [], new, lora_loads=loads))
    first.append(out.sampled_token_ids[0])
    for k in range(1, output_len):
        running = RunningColumns(
            seq_ids=list(range(1, NUM_REQUESTS + 1)),
            num_scheduled_tokens=[1] * NUM_REQUESTS,
            num_computed_tokens=[PROMPT_LEN + k - 1] * NUM_REQUESTS,
            num_new_blocks=[0] * NUM_REQUESTS,
            new_block_ids=[],
            lora_slot=row_slots if names else [],
        )
        out = engine.step(StepPlanData(step_id + k, [], [], running))
        first.append(out.sampled_token_ids[0])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return wall, cpu, step_id + output_len, first[:8]


def ratios(values: list[float], base: list[float]) -> list[float]:
    """Each round's value over the base's in the same round."""
    return [v / b for v, b in zip(values, base, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128, help="tokens per request (<= 128)")
    parser.add_argument(
        "--adapter-counts", type=int, nargs="+", default=[1, 4, 16], help="k adapters per batch"
    )
    parser.add_argument(
        "--num-threads", type=int, default=0, help="torch threads (0: torch's default)"
    )
    parser.add_argument(
        "--shapes", nargs="+", default=list(TARGETS), choices=list(TARGETS), help="adapter shapes"
    )
    parser.add_argument(
        "--qv-counts", type=int, nargs="+", default=None, help="k for qv (default: as all)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/lora_cpu.json")
    args = parser.parse_args()
    config = EngineConfig(
        device="cpu", num_kv_blocks=NUM_REQUESTS * 17 + 8, block_size=BLOCK_SIZE,
        max_num_seqs=NUM_REQUESTS, max_loras=16, max_lora_rank=RANK, max_cpu_loras=32,
        num_threads=args.num_threads,
    )  # fmt: skip
    output_len = args.output_len
    engine = Engine(config)
    configs: list[tuple[str, list[str]]] = [("base", [])]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for i in range(16):
                name = f"{shape}-{i}"
                path = write_adapter(Path(tmp) / name, TARGETS[shape], seed=i)
                engine.add_lora(name, str(path))
            counts = args.qv_counts if shape == "qv" and args.qv_counts else args.adapter_counts
            configs += [(f"{shape} x{k}", [f"{shape}-{i}" for i in range(k)]) for k in counts]
        step_id = 1
        rows: dict[str, list[float]] = {name: [] for name, _ in configs}
        cpu_rows: dict[str, list[float]] = {name: [] for name, _ in configs}
        firsts: dict[str, list[int]] = {}
        run_batch(engine, [], step_id, output_len)  # warm-up (kernel build, allocator)
        step_id += output_len
        for round_index in range(args.rounds):
            for name, names in configs:
                seconds, cpu, step_id, first = run_batch(engine, names, step_id, output_len)
                rows[name].append(NUM_REQUESTS * output_len / seconds)
                cpu_rows[name].append(NUM_REQUESTS * output_len / cpu)
                firsts[name] = first
                print(
                    f"round {round_index} {name:>8}: {rows[name][-1]:7.1f} output tok/s, "
                    f"{cpu_rows[name][-1]:7.1f} per CPU second",
                    flush=True,
                )
    base, cpu_base = rows["base"], cpu_rows["base"]
    results = [
        {
            "config": name,
            "target_modules": TARGETS[name.split()[0]] if names else [],
            "num_adapters": len(names),
            "output_tok_s": [round(v, 1) for v in rows[name]],
            "output_tok_s_median": round(statistics.median(rows[name]), 1),
            "ratio_to_base_per_round": [round(r, 3) for r in ratios(rows[name], base)],
            "ratio_to_base_median": round(statistics.median(ratios(rows[name], base)), 3),
            "output_tok_per_cpu_s": [round(v, 1) for v in cpu_rows[name]],
            "cpu_ratio_to_base_per_round": [round(r, 3) for r in ratios(cpu_rows[name], cpu_base)],
            "cpu_ratio_to_base_median": round(
                statistics.median(ratios(cpu_rows[name], cpu_base)), 3
            ),
            "first_tokens_request_0": firsts[name],
        }
        for name, names in configs
    ]
    document: dict[str, Any] = {
        "study": "lora_cpu",
        "workload": {
            "model": "built-in SmolLM2-135M-Instruct (GGUF Q4_1, served as GGUF blocks)",
            "num_requests": NUM_REQUESTS, "prompt_len": PROMPT_LEN, "output_len": output_len,
            "rank": RANK, "rounds": args.rounds, "greedy": True,
            "torch_threads": args.num_threads or "torch's default",
            "driver": "in-process engine steps (bench/studies/lora_cpu.py), no gRPC",
        },
        "hardware": hardware(torch_threads=True),
        "results": results,
    }  # fmt: skip
    save(document, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
