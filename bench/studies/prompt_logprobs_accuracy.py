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
from pathlib import Path
from typing import Any

from llmserve.bench.report import hardware
from llmserve.common.model_config import builtin_model_path
from llmserve.common.sampling import normalized
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto, result_to_proto
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import SamplingParams
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import apply_result, plan_to_proto

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "prompt_logprobs_accuracy_cpu.json"
REFERENCE = ROOT / "tests" / "data" / "hf_prompt_logprobs_smollm2.json"


def run_requests(engine: Engine, requests: list[Request], budget: int) -> None:
    """The scheduler and engine in one process, through the real contract, until idle."""
    info = engine.info
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=info.max_num_seqs, max_num_batched_tokens=budget),
        info.num_blocks, info.block_size, info.max_model_len, info.vocab_size,
        info.eos_token_ids,
    )  # fmt: skip
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work:
        plan = scheduler.schedule()
        if not plan.is_empty:
            output = engine.step(plan_from_proto(plan_to_proto(plan)))
            apply_result(scheduler, plan, result_to_proto(plan.step_id, output, 0.0))


def one_run(budget: int, reference: dict[str, Any]) -> dict[str, Any]:
    path = builtin_model_path()
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, seed=7))
    k, greedy = reference["top"], normalized(SamplingParams(temperature=0.0))
    requests = [
        Request(f"r{i}", i, p["ids"], greedy, 1, prompt_logprobs=True, prompt_top_logprobs=k)
        for i, p in enumerate(reference["prompts"])
    ]
    run_requests(engine, requests, budget)
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
    reference = json.loads(REFERENCE.read_text())  # scripts/make_hf_prompt_logprobs.py
    rows = [one_run(budget, reference) for budget in (256, 8) for _ in range(args.runs)]
    result = {"hardware": hardware(), "model": reference["model_file"], "runs": rows}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
