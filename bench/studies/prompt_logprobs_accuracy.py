"""How far the engine's prompt logprobs of the built-in model are from transformers' (the GGUF in
float32, tests/data/hf_prompt_logprobs_smollm2.json): the largest |difference| of the prompt
tokens' logprobs and of their top-5, with each prompt whole in one step and in steps of 8 tokens
(a fresh engine per run: its dense-or-blocks weight choice is measured at start and logged).
Writes bench/results/prompt_logprobs_accuracy_cpu.json; tests/engine/test_prompt_logprobs.py
takes its tolerance from it.

    python -m bench.studies.prompt_logprobs_accuracy [--runs 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from llmserve.common.model_config import builtin_model_path
from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine
from tests.engine.test_prompt_logprobs import hf_prompt_logprobs, request
from tests.spec_driver import drive, make_scheduler_for

OUT = Path(__file__).resolve().parents[1] / "results" / "prompt_logprobs_accuracy_cpu.json"


def cpu_name() -> str:
    lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Model name")]
    return names[0] if names else platform.processor()


def one_run(budget: int, reference: dict[str, Any]) -> dict[str, Any]:
    path = builtin_model_path()
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, seed=7))
    k = reference["top"]
    requests = [request(i, p["ids"], 1, k=k) for i, p in enumerate(reference["prompts"])]
    drive(make_scheduler_for(engine, max_num_batched_tokens=budget), engine, requests)
    token_diff = top_diff = 0.0
    top1_equal = True
    for r, ref in zip(requests, reference["prompts"], strict=True):
        for j, s in enumerate(r.prompt_scores):
            token_diff = max(token_diff, abs(s.logprob - ref["logprobs"][j]))
            pairs = zip(s.top_logprobs, ref["top_logprobs"][j], strict=True)
            top_diff = max(top_diff, *(abs(a - b) for a, b in pairs))
            top1_equal &= s.top_token_ids[0] == ref["top_ids"][j][0]
    return {
        "tokens_per_step": budget,
        "num_positions": sum(len(r.prompt_scores) for r in requests),
        "max_abs_diff_prompt_token": token_diff,
        "max_abs_diff_top5": top_diff,
        "top1_equal": top1_equal,
        # Which weights each step ran on (measured at the engine's start) and how many steps
        # took the packed blocks / the dense copy.
        "weight_path": engine.model.weight_path.figures() if engine.model.weight_path else None,
        "weight_steps": engine.model.weight_path.steps if engine.model.weight_path else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="fresh engines per step size")
    args = parser.parse_args()
    reference = hf_prompt_logprobs(builtin_model_path())
    rows = [one_run(budget, reference) for budget in (256, 8) for _ in range(args.runs)]
    result = {"cpu": cpu_name(), "model": reference["model_file"], "runs": rows}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
