"""Issue 27's measurement: what structured output costs, in-process (the real Scheduler driving
the real Engine, two steps in flight as the service runs them), on the built-in model on a CPU.

    python -m bench.studies.structured_cpu [--out bench/results/structured_cpu.json] [--rounds 2]

16 requests at once, 128-token prompts, 128 output tokens each (greedy; the schema is long
enough that no constrained output completes before 128 tokens, so every request makes 128),
with 0%, 25% and 100% of them constrained by a mid-sized JSON schema (an order: nested objects,
an array of 8-16 line items, enums, patterns, number ranges). The fractions take turns for
--rounds rounds (0, 25, 100, 0, ...) so that a slow spell of the machine hits each alike; output
tok/s is all requests' output tokens over the wall time from admission to the last token. Also:
the mask time per constrained row per step (the engine's mask thread, which runs beside the
forward), and the grammar compile time, cold (16 variants of the schema, each compiled for the
first time) and cached (the same keys again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

from llmserve.bench.report import hardware, save
from llmserve.common.structured_output import constraint_of
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import SamplingParams, StructuredOutput
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto

ROOT = Path(__file__).resolve().parents[2]
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 16, 128, 128

_LINE = {
    "type": "object",
    "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "name": {"type": "string", "minLength": 8, "maxLength": 40},
        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
        "price": {"type": "number", "minimum": 0, "maximum": 10000},
        "category": {"enum": ["books", "games", "garden", "kitchen", "tools"]},
    },
    "required": ["sku", "name", "qty", "price", "category"],
    "additionalProperties": False,
}
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "integer", "minimum": 1},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["name", "email"],
        },
        "status": {"enum": ["new", "paid", "shipped", "delivered"]},
        "lines": {"type": "array", "items": _LINE, "minItems": 8, "maxItems": 16},
    },
    "required": ["order_id", "customer", "status", "lines"],
    "additionalProperties": False,
}


def _requests(engine: Engine, fraction: float, tag: str) -> list[Request]:
    constrained = round(NUM_REQUESTS * fraction)
    schema = StructuredOutput(json_schema=json.dumps(ORDER_SCHEMA))
    out = []
    for i in range(NUM_REQUESTS):
        params = SamplingParams(temperature=0.0, top_p=1.0)
        if i < constrained:
            params.structured_output.CopyFrom(schema)
        prompt = [(i * 131 + j * 17) % 20000 + 100 for j in range(PROMPT_LEN)]
        out.append(Request(f"{tag}-{i}", i + 1, prompt, params, OUTPUT_LEN, ignore_eos=True))
    return out


def run(engine: Engine, fraction: float, tag: str) -> dict[str, Any]:
    """One batch of NUM_REQUESTS at `fraction` constrained, to the end."""
    engine.reset()
    info = engine.info
    s = Scheduler(
        SchedulerConfig().adopt(info.max_num_seqs, info.max_num_batched_tokens),
        info.num_blocks, info.block_size, info.max_model_len, info.vocab_size, info.eos_token_ids,
    )  # fmt: skip
    grammars = engine.grammars
    masks0, mask_s0 = grammars.num_masks, grammars.mask_s
    t0 = time.perf_counter()
    for r in _requests(engine, fraction, tag):
        s.add(r)
    num_tokens, steps = 0, 0
    in_flight: deque[tuple[Any, Any]] = deque()
    while s.has_work or in_flight:
        if len(in_flight) < 2 and s.has_work:
            plan = s.schedule()
            if not plan.is_empty:
                in_flight.append((plan, engine.launch(plan_from_proto(plan_to_proto(plan)))))
                continue
        plan, step = in_flight.popleft()
        out = engine.finish(step)
        s.grammars_compiled(out.compiled_seq_ids)
        num_tokens += len(s.update(plan, out.sampled_token_ids, out.logprobs))
        steps += 1
    wall = time.perf_counter() - t0
    num_masks = grammars.num_masks - masks0
    return {
        "fraction_constrained": fraction,
        "output_tokens": num_tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(num_tokens / wall, 2),
        "steps": steps,
        "masked_row_steps": num_masks,
        "mask_ms_per_row_step": (
            round((grammars.mask_s - mask_s0) / num_masks * 1e3, 3) if num_masks else None
        ),
    }


def compile_times(engine: Engine) -> dict[str, Any]:
    """Compile 16 variants of the order schema (its maxItems 17..32: texts no run compiled)."""
    grammars = engine.grammars
    keys = []
    for i in range(16):
        variant = json.loads(json.dumps(ORDER_SCHEMA))
        variant["properties"]["lines"]["maxItems"] = 17 + i
        keys.append(("json_schema", json.dumps(variant)))
    cold, cached = [], []
    for key in keys:
        t0 = time.perf_counter()
        grammars.compiled(key).result()
        cold.append((time.perf_counter() - t0) * 1e3)
    for key in keys:
        t0 = time.perf_counter()
        grammars.compiled(key).result()
        cached.append((time.perf_counter() - t0) * 1e3)
    return {
        "num_schemas": len(keys),
        "cold_ms_median": round(statistics.median(cold), 3),
        "cold_ms_max": round(max(cold), 3),
        "cached_ms_median": round(statistics.median(cached), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/structured_cpu.json")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--fractions", default="0,0.25,1", help="fractions of the requests constrained, in turn"
    )
    # The 8B shape on a GPU: --device cuda --model configs/llama-3-8b --load-format dummy
    # (random weights, the byte-level tokenizer: the grammar then works on bytes).
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: the built-in model")
    parser.add_argument("--load-format", default="auto")
    # One torch thread by default: on a shared machine OpenMP's spinning barriers make two
    # threads far slower than one (the tests' one_torch_thread fixture says the same).
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args()
    fractions = tuple(float(f) for f in args.fractions.split(","))
    engine = Engine(
        EngineConfig(
            model=args.model, device=args.device, load_format=args.load_format,
            max_num_seqs=NUM_REQUESTS, kv_cache_gb=0.5 if args.device == "cpu" else 0.0,
            max_model_len=1024, num_threads=args.num_threads,
        )
    )  # fmt: skip
    t0 = time.perf_counter()  # the vocabulary, once (the first constrained request's wait)
    so = StructuredOutput(json_schema=json.dumps(ORDER_SCHEMA))
    key = constraint_of(so)
    assert key is not None
    engine.grammars.compiled(key).result()
    vocabulary_s = time.perf_counter() - t0
    run(engine, 0.0, "warmup")
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for fraction in fractions:
            runs.append({"round": r, **run(engine, fraction, f"r{r}-{fraction}")})
            print(json.dumps(runs[-1]), flush=True)
    summary: dict[str, dict[str, Any]] = {}
    for fraction in fractions:
        rates = [x["output_tok_s"] for x in runs if x["fraction_constrained"] == fraction]
        summary[str(fraction)] = {"output_tok_s_median": statistics.median(rates), "runs": rates}
    if "0.0" in summary:
        base = summary["0.0"]["output_tok_s_median"]
        for fraction in fractions:
            summary[str(fraction)]["vs_none"] = round(
                summary[str(fraction)]["output_tok_s_median"] / base, 3
            )
    masks = [x["mask_ms_per_row_step"] for x in runs if x["mask_ms_per_row_step"] is not None]
    document = {
        "what": "structured output: 16 concurrent, 128 in / 128 out",
        "device": args.device,
        "torch_threads": args.num_threads,
        "model": args.model or "built-in SmolLM2-135M-Instruct",
        "hardware": hardware(torch_threads=True),
        "note": "compare the fractions, which alternate within one run"
        + (
            "; a shared 2-core VM with other jobs running: absolute figures are inflated"
            if args.device == "cpu"
            else ""
        ),
        "schema": ORDER_SCHEMA,
        "vocabulary_build_s": round(vocabulary_s, 3),
        "summary": summary,
        "mask_ms_per_row_step_median": statistics.median(masks) if masks else None,
        "compile": compile_times(engine),
        "runs": runs,
    }
    save(document, args.out)
    print(json.dumps({k: document[k] for k in ("summary", "compile")}, indent=1))


if __name__ == "__main__":
    main()
