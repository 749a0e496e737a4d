"""Issue 26's CPU figure: one decode step of a ~135M-parameter random model of each served
family beside the Llama one, in-process (no gRPC), at batch 1 and 16.

Every family takes SmolLM2-135M's shape (configs/smollm2-135m: hidden 576, 30 layers, 9 heads /
3 KV heads, MLP 1536, vocab 49152) in its own layout, with --load-format dummy: Qwen2 with its
q/k/v biases, Qwen3 with q/k norms, Mistral, Gemma 2 and 3 and Phi-3 with a 64-token sliding
window (shorter than the 128-token prompts, so the windowed decode path runs), Gemma 2's
soft-caps, Phi-3's partial rotary (0.75); Qwen3-MoE and Qwen2-MoE with every MLP made 8
experts of width 192, top-2 (Qwen2-MoE with a shared expert of 384). Llama runs first and again
last: the gap between its two runs is the machine's drift over the run.

    python -m bench.family_steps [--out bench/results/family_steps.json] [--families a,b]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.engine import Engine
from llmserve.bench.engine_driver import time_decode_steps
from llmserve.bench.report import hardware, save

ROOT = Path(__file__).resolve().parent.parent
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
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 64,
        "norm_topk_prob": True, **MOE,
    },
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
        "shared_expert_intermediate_size": 384, **MOE,
    },
}  # fmt: skip


def family_dir(base: Path, family: str) -> Path:
    cfg = json.loads((ROOT / "configs" / "smollm2-135m" / "config.json").read_text())
    cfg.update(FAMILIES[family])
    directory = base / family
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def run(path: Path, batches: list[int], steps: int) -> list[dict[str, Any]]:
    config = EngineConfig(
        model=str(path), device="cpu", load_format="dummy", num_kv_blocks=1200, seed=0
    )
    engine = Engine(config)
    return [time_decode_steps(engine, b, steps) for b in batches]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--families", default=",".join(FAMILIES), help="a subset, comma-separated")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "family_steps.json")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        chosen = [f for f in FAMILIES if f in args.families.split(",")]
        for family in ["llama", *(f for f in chosen if f != "llama"), "llama"]:
            rows = run(_fresh(Path(tmp), family, len(results)), batches, args.steps)
            results.append({"family": family, "config": FAMILIES[family], "rows": rows})
            times = " ".join(f"b{r['batch']}={r['step_ms_median']}ms" for r in rows)
            print(family, times, flush=True)
    base = {r["batch"]: r["step_ms_median"] for r in results[0]["rows"]}
    print(f"\n{'family':10s}" + "".join(f"{f'batch {b} ms (x llama)':>26s}" for b in batches))
    for result in results:
        cells = "".join(
            f"{r['step_ms_median']:>16.1f} ({r['step_ms_median'] / base[r['batch']]:4.2f}x)"
            for r in result["rows"]
        )
        print(f"{result['family']:10s}{cells}")
    save(
        {"hardware": hardware(torch_threads=True), "steps": args.steps, "results": results},
        args.out,
    )
    print(f"\nraw JSON: {args.out}")


def _fresh(base: Path, family: str, index: int) -> Path:
    """family's directory under base, named apart from an earlier run of the same family."""
    sub = base / str(index)
    sub.mkdir()
    return family_dir(sub, family)


if __name__ == "__main__":
    main()
