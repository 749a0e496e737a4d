"""Decode-step time and peak memory of quantized checkpoints served as stored on the CPU
(kernels/cpu_wq.cpp through engine/model/checkpoint_linear.py), against float32 of the same
model: the built-in SmolLM2-135M written in each format by llmserve/bench/quant_checkpoints.py
(bench/studies/checkpoint_formats_quality.py's writers), each served by its own process (peak RSS is
the process's VmHWM), one torch thread, batch 1 and 16, as bench/results/
cpu_engine_steps_gguf.json measured the GGUF blocks; the built-in Q4_1 GGUF itself is served
with --quantization gguf in the same run, beside them.

    python bench/studies/checkpoint_kernels_cpu.py [--steps 5] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("float32", "gptq-w4a16-g128", "ct-w8a16-channel", "fp8-block-128", "gguf-builtin")
BATCHES = (1, 16)
PROMPT_LEN = 32


def write(fmt: str, float_dir: Path, root: Path) -> Path:
    from llmserve.bench import quant_checkpoints as qc

    if fmt == "float32":
        return float_dir
    if fmt == "gguf-builtin":  # the same model's own file, served by --quantization gguf
        from llmserve.common.model_config import builtin_model_path

        return builtin_model_path()
    out, dequantized = root / fmt, root / f"{fmt}-dequantized"
    if fmt == "gptq-w4a16-g128":
        qc.write_gptq(float_dir, out, dequantized, bits=4, group_size=128, desc_act=False)
    elif fmt == "ct-w8a16-channel":
        w8 = {"type": "int", "symmetric": True, "num_bits": 8, "strategy": "channel"}
        qc.write_compressed_tensors(float_dir, out, dequantized, w8, None, "int-quantized")
    else:
        qc.write_fp8_block(float_dir, out, dequantized, (128, 128))
    return out


def serve(path: str, steps: int, quantization: str) -> dict[str, Any]:
    """In this process: the engine on `path`, the decode step at each batch, peak RSS."""
    import torch

    from llmserve.bench.engine_driver import time_decode_steps
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.model.checkpoint_linear import kept_description
    from llmserve.engine.step.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(
        EngineConfig(model=path, device="cpu", num_kv_blocks=256, max_model_len=256,
                     quantization=quantization)
    )  # fmt: skip
    rows = [time_decode_steps(engine, b, steps, prompt_len=PROMPT_LEN) for b in BATCHES]
    from llmserve.bench.step import peak_rss_mib

    return {"kept": kept_description(engine.model), "rows": rows, "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench/results/checkpoint_kernels_cpu.json"))
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--quantization", default="none", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(args.serve, args.steps, args.quantization)))
        return
    from bench.studies.checkpoint_formats_quality import float_checkpoint
    from llmserve.bench.report import hardware

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        float_dir = float_checkpoint(Path(tmp) / "float")
        for fmt in FORMATS:
            path = write(fmt, float_dir, Path(tmp))
            quantization = "gguf" if fmt == "gguf-builtin" else "none"
            cmd = [sys.executable, __file__, "--serve", str(path), "--steps", str(args.steps),
                   "--quantization", quantization]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
            results.append({"format": fmt, **json.loads(done.stdout.strip().splitlines()[-1])})
            print(json.dumps(results[-1])[:300], flush=True)
    report = {
        "hardware": hardware(torch_threads=True), "model": "SmolLM2-135M (built-in), random "
        "formats written from its float32 weights", "threads": 1, "steps": args.steps,
        "prompt_len": PROMPT_LEN, "results": results,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
