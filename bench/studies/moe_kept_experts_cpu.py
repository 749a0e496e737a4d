"""Decode-step time and peak RSS of a small random mixture-of-experts model whose experts are
kept quantized on the CPU (engine/model/kept_experts.py over kernels/cpu_wq.cpp) against the
same model dequantized to float32:

- Qwen3-MoE shape (6 layers, hidden 768, 32 experts of 384, top-4, vocab 8192) as a GPTQ W4A16
  checkpoint (4-bit, group 128, symmetric), written by llmserve/bench/quant_checkpoints.py;
- gpt-oss shape (the same sizes, biased experts, clamped SwiGLU) as gpt-oss's MXFP4
  checkpoint (quant_checkpoints.write_mxfp4), its experts kept as stored (cpu_wq's fp4 kind).

Timing: one `llmserve bench step --arms model:DIR@none ...` run with all arms paired (ratios
within the run), one torch thread; peak RSS: one run per arm at batch 1 (the process's VmHWM:
engine build, load and steps).

    python bench/studies/moe_kept_experts_cpu.py --out bench/results/moe_kept_experts_cpu.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPE: dict[str, Any] = {
    "vocab_size": 8192, "hidden_size": 768, "num_hidden_layers": 6,
    "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
    "num_experts_per_tok": 4, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 32, "moe_intermediate_size": 384,
                                     "intermediate_size": 2048, "norm_topk_prob": True}),
    "gpt_oss": ("GptOssConfig", {"num_local_experts": 32, "intermediate_size": 384,
                                 "sliding_window": 128}),
}  # fmt: skip


def float_model(directory: Path, family: str) -> Path:
    """A seeded random float32 model of `family` at SHAPE, saved as safetensors."""
    import transformers

    class_name, fields = FAMILIES[family]
    config = getattr(transformers, class_name)(**{**SHAPE, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def bench(arms: list[str], batches: str, steps: int, out: Path) -> dict[str, Any]:
    cli = "from llmserve.cli import main; raise SystemExit(main())"
    cmd = [sys.executable, "-c", cli, "bench", "step", "--arms", *arms, "--threads", "1",
           "--batches", batches, "--steps", str(steps), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> None:
    from llmserve.bench.quant_checkpoints import write_gptq, write_mxfp4

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        qwen = float_model(work / "qwen3_moe", "qwen3_moe")
        write_gptq(qwen, work / "w4", work / "w4-deq", bits=4, group_size=128, desc_act=False)
        oss = float_model(work / "gpt_oss", "gpt_oss")
        write_mxfp4(oss, work / "mxfp4", work / "mxfp4-deq")
        names = {
            f"model:{work / 'w4-deq'}@none": "qwen3_moe float32 (dequantized w4a16)",
            f"model:{work / 'w4'}@none": "qwen3_moe gptq w4a16 g128, experts kept (cpu_wq int4)",
            f"model:{work / 'mxfp4-deq'}@none": "gpt_oss float32 (dequantized mxfp4)",
            f"model:{work / 'mxfp4'}@none": "gpt_oss mxfp4, experts kept (cpu_wq fp4)",
        }
        arms = list(names)
        timing = bench(arms, "1,16", args.steps, work / "timing.json")
        rss = {arm: bench([arm], "1", 3, work / "rss.json")["max_rss_mib"] for arm in arms}
    timing["model"] = {"shape": SHAPE, "families": FAMILIES, "weights": "random, seed 0"}
    for result in timing["results"]:
        spec = result["arm"]
        result["arm"], result["max_rss_mib_alone"] = names[spec], rss[spec]
    args.out.write_text(json.dumps(timing, indent=1) + "\n")
    for result in timing["results"]:
        steps = {row["batch"]: row["step_ms_median"] for row in result["rows"]}
        print(result["arm"], steps, "peak RSS MiB", result["max_rss_mib_alone"])


if __name__ == "__main__":
    main()
