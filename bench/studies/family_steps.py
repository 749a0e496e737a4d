"""Issue 26's CPU figure: one decode step of a ~135M-parameter random model of each served
family beside the Llama one, in-process (no gRPC), at batch 1 and 16, one torch thread.

Every family takes SmolLM2-135M's shape (configs/smollm2-135m: hidden 576, 30 layers, 9 heads /
3 KV heads, MLP 1536, vocab 49152) in its own layout, with --load-format dummy: Qwen2 with its
q/k/v biases, Qwen3 with q/k norms, Mistral, Gemma 2 and 3 and Phi-3 with a 64-token sliding
window (shorter than the 128-token prompts, so the windowed decode path runs), Gemma 2's
soft-caps, Phi-3's partial rotary (0.75); Mixtral, Qwen3-MoE and Qwen2-MoE with every MLP made
8 experts of width 192, top-2 (Qwen2-MoE with a shared expert of 384).

Each family is timed beside the Llama model in the same run: both engines prefill the same
prompts, then their decode steps alternate (Llama, family, family, Llama, ...), so a machine
whose load drifts slows both alike; the figure is the ratio of the medians.

    python -m bench.studies.family_steps [--out bench/results/family_steps.json] [--families a,b]
    python -m bench.studies.family_steps
        --table bench/results/family_steps.json   (docs/models.md's)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from llmserve.bench.engine_driver import Driver, blocks_needed
from llmserve.bench.report import hardware, save
from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
WINDOW = 64
GEMMA = {
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": WINDOW,
    "hidden_activation": "gelu_pytorch_tanh",
}
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64},
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": WINDOW,
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        **GEMMA,
    },
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **GEMMA},
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "partial_rotary_factor": 0.75,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
    },
    # Mixture of experts: every MLP a sparse block of the same total width (8 experts of 192,
    # top-2: the MLP's parameters, a quarter of them active); Qwen2-MoE adds a shared expert.
    "mixtral": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 192,
    },
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 64,
        "norm_topk_prob": True, **MOE,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 384, **MOE,
    },
    # SmolLM3: every 4th layer without rotary. GLM-4.5: DeepSeek-V3's MoE (8 experts of 192 in 4
    # groups, the best 2 kept, top-2, one shared expert of 192; layer 0 dense), partial rotary.
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3"},
    "glm4_moe": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "head_dim": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192,
        "n_group": 4, "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "partial_rotary_factor": 0.5,
    },
    # DeepSeek-V3: multi-head latent attention as DeepSeek-V2-Lite lays it out (no q latent;
    # here a latent of 192 + 32 rotary values, nope 64, v 64: 224 values a token a layer against
    # Llama's 2 x 3 x 64 = 384), GLM-4.5's MoE as above.
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "q_lora_rank": None, "kv_lora_rank": 192, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32,
        "v_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 192, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    },
    # gpt-oss: attention sinks, a 64-token window on every other layer, q/k/v/o biases, 8 biased
    # experts of 192 under the clamped SwiGLU, top-2 (the sinks take the reference attention).
    "gpt_oss": {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
        "sliding_window": WINDOW, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 192, "swiglu_limit": 7.0, "attention_bias": True,
    },
}  # fmt: skip


def family_dir(base: Path, family: str) -> Path:
    cfg = json.loads((ROOT / "configs" / "smollm2-135m" / "config.json").read_text())
    cfg.update(FAMILIES[family])
    directory = base / family
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def load(path: Path, threads: int, num_blocks: int) -> Engine:
    config = EngineConfig(
        model=str(path), device="cpu", load_format="dummy", num_kv_blocks=num_blocks, seed=0,
        num_threads=threads,
    )  # fmt: skip
    return Engine(config)


def paired_steps(
    engines: list[Engine], batch: int, steps: int, prompt_len: int = 128
) -> list[list[float]]:
    """Each engine's decode step times (ms) at `batch`: every engine prefills the same prompts,
    3 decode steps warm each up, then `steps` rounds each time one step of every engine, in
    turn, the order reversed every other round (ABBA)."""
    prompts = [[100 + i] * (prompt_len - 1) + [5] for i in range(batch)]
    drivers = [Driver(engine) for engine in engines]
    for driver in drivers:
        driver.start(prompts)
        for _ in range(3):
            driver.decode()
    times: list[list[float]] = [[] for _ in engines]
    for step in range(steps):
        order = list(range(len(drivers)))
        for i in order if step % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            drivers[i].decode()
            times[i].append((time.perf_counter() - t0) * 1e3)
    return times


def row(batch: int, times: list[float], base: list[float]) -> dict[str, Any]:
    median, llama = statistics.median(times), statistics.median(base)
    return {
        "batch": batch,
        "step_ms_median": round(median, 2),
        "llama_step_ms_median": round(llama, 2),
        "vs_llama": round(median / llama, 3),
        "step_ms": [round(t, 2) for t in times],
        "llama_step_ms": [round(t, 2) for t in base],
    }


def markdown_table(doc: dict[str, Any]) -> str:
    """docs/models.md's table of a saved run: per family and batch, its step and Llama's beside
    it (ms), and their ratio."""
    results = doc["results"]
    batches = [r["batch"] for r in results[0]["rows"]]
    head = "| family |" + "".join(f" batch {b}: ms (Llama's) | x Llama |" for b in batches)
    lines = [head, "|---|" + "---:|---:|" * len(batches)]
    for result in results:
        cells = "".join(
            f" {r['step_ms_median']:.0f} ({r['llama_step_ms_median']:.0f}) | {r['vs_llama']:.2f} |"
            for r in result["rows"]
        )
        lines.append(f"| {result['family']} |{cells}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--table", type=Path, help="print a saved run's markdown table and exit")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--families", default=",".join(FAMILIES), help="a subset, comma-separated")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "family_steps.json")
    args = p.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = blocks_needed([128] * max(batches), args.steps + 8, 16)
    results = []
    load_averages = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        llama = load(family_dir(Path(tmp), "llama"), args.threads, num_blocks)
        chosen = [f for f in FAMILIES if f in args.families.split(",") and f != "llama"]
        for family in chosen:
            engine = load(family_dir(Path(tmp), family), args.threads, num_blocks)
            rows = []
            for b in batches:
                base, times = paired_steps([llama, engine], b, args.steps)
                rows.append(row(b, times, base))
            del engine
            load_averages.append(os.getloadavg()[0])
            results.append({"family": family, "config": FAMILIES[family], "rows": rows})
            cells = " ".join(
                f"b{r['batch']}={r['step_ms_median']}ms ({r['vs_llama']}x llama "
                f"{r['llama_step_ms_median']}ms)"
                for r in rows
            )
            print(family, cells, f"load {load_averages[-1]:.1f}", flush=True)
    print(f"\n{'family':10s}" + "".join(f"{f'batch {b} ms (x llama)':>26s}" for b in batches))
    for result in results:
        text = "".join(
            f"{r['step_ms_median']:>16.1f} ({r['vs_llama']:4.2f}x)" for r in result["rows"]
        )
        print(f"{result['family']:10s}{text}")
    save(
        {
            "hardware": hardware(torch_threads=True),
            "threads": args.threads,
            "steps": args.steps,
            "load_average_1min": [round(a, 2) for a in load_averages],
            "results": results,
        },
        args.out,
    )
    print(f"\nraw JSON: {args.out}")


if __name__ == "__main__":
    main()
