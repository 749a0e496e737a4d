"""Prompt logprobs through the step contract, in one process (tests/spec_driver.py: the real
scheduler, the engine, protobuf both ways): every prompt token after the first scored once,
through chunked prefill, a prefix-cache hit skipped, speculation and preemption; and the built-in
model's scores equal transformers' (tests/data/hf_prompt_logprobs_smollm2.json, made by
scripts/make_hf_prompt_logprobs.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig
from llmserve.scheduler.request import PromptScore, Request
from tests.factories import sampling
from tests.spec_driver import Driven, drive, make_scheduler_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "make_hf_prompt_logprobs.py"
VOCAB = 100


def request(seq_id: int, prompt: list[int], max_tokens: int, k: int | None = None) -> Request:
    """A greedy request; k: prompt logprobs with k alternatives (None: none asked)."""
    return Request(
        f"req-{seq_id}", seq_id, prompt, sampling(temperature=0.0), max_tokens,
        prompt_logprobs=k is not None, prompt_top_logprobs=k or 0,
    )  # fmt: skip


def echo_engine(num_blocks: int = 64, k: int = 0) -> EchoEngine:
    config = EngineConfig(block_size=4, num_kv_blocks=num_blocks, max_model_len=256)
    return EchoEngine(
        config, EchoEngineConfig(vocab_size=VOCAB, eos_token_ids=(99,), num_speculative_tokens=k)
    )


def echo_scores(prompt: list[int], k: int) -> list[PromptScore]:
    """The echo engine's scores (engine/contract/echo.py) of prompt's tokens after the first."""
    return [
        PromptScore(
            -0.5 * (j % 3),
            1 + j % 3,
            [(t - j % 3 + m) % VOCAB for m in range(k)],
            [-0.5 * m for m in range(k)],
        )
        for j, t in enumerate(prompt[1:], start=1)
    ]


PROMPT = [(5 * i) % 90 + 1 for i in range(21)]


@pytest.mark.parametrize("budget", [4, 7, 64], ids=["chunks-of-4", "chunks-of-7", "whole"])
def test_every_prompt_token_scored_once_through_chunks(budget: int) -> None:
    """Chunked or not, the scores arrive in order, one per prompt token after the first; a
    request that does not ask gets none, and the tokens are unchanged."""
    engine = echo_engine()
    asked, plain = request(1, PROMPT, 3, k=2), request(2, PROMPT[::-1], 3)
    run = drive(make_scheduler_for(engine, max_num_batched_tokens=budget), engine, [asked, plain])
    assert asked.prompt_scores == echo_scores(PROMPT, 2)
    assert plain.prompt_scores == []
    assert run.outputs[1] == PROMPT[:3]


def test_prefix_cache_hit_is_skipped_for_a_request_that_asks() -> None:
    """A cached prompt is computed again for a request asking prompt logprobs (its positions
    must be scored); one that does not ask still hits the cache."""
    engine = echo_engine()
    scheduler = make_scheduler_for(engine)
    drive(scheduler, engine, [request(1, PROMPT, 2)])
    asked, plain = request(2, PROMPT, 2, k=0), request(3, PROMPT, 2)
    drive(scheduler, engine, [asked])
    drive(scheduler, engine, [plain])
    assert asked.num_cached_tokens == 0 and asked.prompt_scores == echo_scores(PROMPT, 0)
    assert plain.num_cached_tokens == 20  # five full blocks of 4 (one token is always computed)


def test_speculation_and_preemption_keep_the_scores() -> None:
    """With speculation (the request's prefill gets no lookahead) and with preemptions (a
    recompute scores the prompt again; the scheduler keeps the first copy), the scores and
    tokens are those of a plain run."""
    prompts = [[(7 * s + i) % 90 + 1 for i in range(9 + 3 * s)] for s in range(5)]

    def run(engine: EchoEngine, **config: Any) -> tuple[list[list[PromptScore]], Driven, Any]:
        requests = [request(i, p, 12, k=1) for i, p in enumerate(prompts)]
        scheduler = make_scheduler_for(engine, **config)
        driven = drive(scheduler, engine, requests)
        return [r.prompt_scores for r in requests], driven, scheduler.counters

    expected = [echo_scores(p, 1) for p in prompts]
    scores, plain, _ = run(echo_engine())
    assert scores == expected
    scores, driven, _ = run(echo_engine(k=3))  # speculated: fewer steps, the same tokens
    assert scores == expected and driven.outputs == plain.outputs
    assert driven.num_steps < plain.num_steps
    scores, driven, counters = run(echo_engine(num_blocks=14), max_num_batched_tokens=8)
    assert scores == expected and driven.outputs == plain.outputs and counters.num_preemptions


# -- the built-in model against transformers ---------------------------------------------------


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_hf_prompt_logprobs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_prompt_logprobs(model_path: Path) -> dict[str, Any]:
    """The stored transformers reference, checked to be for this model file and transformers
    version (else the test fails naming the script that regenerates it)."""
    script = _script()
    stored = json.loads(script.REFERENCE_PATH.read_text())
    key = script._make_hf_reference().reference_key(model_path)
    for field, value in key.items():
        if stored.get(field) != value:
            pytest.fail(
                f"{script.REFERENCE_PATH.name} is stale: {field} is {stored.get(field)!r} there "
                f"but {value!r} here; regenerate it: python scripts/{SCRIPT.name}"
            )
    return stored


# The largest |served - transformers| logprob allowed (float32 both ways). Rows run on the
# dequantized dense weights or on the GGUF blocks kernels, by a threshold the engine measures at
# start (its cpu_weights choice): dense matched to 3.4e-5, blocks to 3.0e-3 over the top-5
# (bench/results/prompt_logprobs_accuracy_cpu.json). A score at the wrong position would be off
# by nats, not thousandths.
TOLERANCE = 6e-3
BUDGETS = (256, 8)  # tokens per step: each prompt whole, then in chunks of 8


def test_builtin_model_prompt_logprobs_match_transformers(
    builtin_model_path: Path, one_torch_thread: None
) -> None:
    """The served prompt logprobs and top-5 of the built-in model equal transformers' log_softmax
    of the same GGUF's logits, with the prompts whole and in chunks of 8 tokens per step (both
    prompts in the steps together)."""
    from llmserve.engine.step.engine import Engine

    reference = hf_prompt_logprobs(builtin_model_path)
    config = EngineConfig(model=str(builtin_model_path), device="cpu", num_kv_blocks=64, seed=7)
    engine = Engine(config)
    k = reference["top"]
    for budget in BUDGETS:
        engine.reset()  # a new scheduler numbers its steps from 1 again
        requests = [request(i, p["ids"], 1, k=k) for i, p in enumerate(reference["prompts"])]
        drive(make_scheduler_for(engine, max_num_batched_tokens=budget), engine, requests)
        for r, ref in zip(requests, reference["prompts"], strict=True):
            assert len(r.prompt_scores) == len(ref["ids"]) - 1
            served = [s.logprob for s in r.prompt_scores]
            assert served == pytest.approx(ref["logprobs"], abs=TOLERANCE)
            tops = zip(r.prompt_scores, ref["top_ids"], ref["top_logprobs"], strict=True)
            for s, ids, lps in tops:
                assert s.top_logprobs == pytest.approx(lps, abs=TOLERANCE)
                assert s.top_token_ids[0] == ids[0]  # the others may swap on a near tie
                assert s.rank == 1 + sum(lp > s.logprob for lp in s.top_logprobs) or s.rank > k
