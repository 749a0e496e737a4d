"""Decode-step time and peak RSS of a SmolLM2-135M-shaped random model as W4A16 (GPTQ 4-bit,
group 128, symmetric: Q4_0 blocks) and W8A16 (GPTQ 8-bit, group 128: Q8_0 blocks) checkpoints
written by llmserve/bench/quant_checkpoints.py, each served kept in the CPU kernel's blocks
(--quantization gguf, engine/model/checkpoint_blocks.py) against dequantized to float32 (none).

Timing: one `llmserve bench step` run with all arms paired (ratios within the run); peak RSS:
one run per arm at batch 1 (the process's VmHWM: engine build, load and steps).

    python bench/studies/kept_blocks_step.py --out bench/results/kept_blocks_step.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def float_model(directory: Path) -> Path:
    """A seeded random float32 Llama at configs/smollm2-135m's shape, saved as safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((ROOT / "configs" / "smollm2-135m" / "config.json").read_text())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**config, "torch_dtype": "float32"})).float()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def bench(arms: list[str], batches: str, steps: int, out: Path) -> dict:
    cli = "from llmserve.cli import main; raise SystemExit(main())"
    cmd = [sys.executable, "-c", cli, "bench", "step", "--arms", *arms,
           "--batches", batches, "--steps", str(steps), "--out", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def main() -> None:
    from llmserve.bench.quant_checkpoints import write_gptq

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = float_model(work / "float")
        dirs = {"w4a16": work / "w4", "w8a16": work / "w8"}
        write_gptq(base, dirs["w4a16"], work / "w4-deq", bits=4, group_size=128, desc_act=False)
        write_gptq(base, dirs["w8a16"], work / "w8-deq", bits=8, group_size=128, desc_act=False)
        # the dequantized float32 twin, the checkpoint kept by cpu_wq (none: main's default on
        # a CPU) and kept in GGUF blocks (gguf: engine/model/checkpoint_blocks.py)
        names = {f"model:{work / 'w4-deq'}@none": "float32 (dequantized w4a16)"}
        for kind, d in dirs.items():
            names[f"model:{d}@none"] = f"{kind} cpu_wq (--quantization none)"
            names[f"model:{d}@gguf"] = f"{kind} GGUF blocks (--quantization gguf)"
        arms = list(names)
        timing = bench(arms, "1,16", args.steps, work / "timing.json")
        rss = {arm: bench([arm], "1", 3, work / "rss.json")["max_rss_mib"] for arm in arms}
    for result in timing["results"]:
        spec = result["arm"]
        result["arm"], result["max_rss_mib_alone"] = names[spec], rss[spec]
    args.out.write_text(json.dumps(timing, indent=1))
    for result in timing["results"]:
        steps = {row["batch"]: row["step_ms_median"] for row in result["rows"]}
        print(result["arm"], steps, "peak RSS MiB", result["max_rss_mib_alone"])


if __name__ == "__main__":
    main()
