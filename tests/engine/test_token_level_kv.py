"""Token-level KV (`--block-size 1`, LightLLM's TokenAttention): a real scheduler and the CPU
engine in one process (tests/spec_driver.py) give, greedy, the same tokens at block size 1 as at
block size 16, through preemptions and prefix-cache hits, and the prefix cache shares exactly to
the token at block size 1 where it shares whole blocks at 16."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine
from llmserve.engine.step.inputs import BlockTables, padded_block_tables
from llmserve.scheduler.request import Request
from tests.factories import sampling
from tests.spec_driver import drive, make_scheduler_for

pytestmark = pytest.mark.usefixtures("one_torch_thread")

POOL_TOKENS = 96  # 4 requests of up to 60 tokens each do not fit: preemptions at both sizes
SHARED = 40  # prefix tokens the second round shares with the first: 2.5 blocks of 16


def workload(rng: random.Random, shared: list[int], first_seq_id: int) -> list[Request]:
    """Four requests, two starting with `shared`; varied prompt lengths, 16 new tokens each."""
    requests = []
    for i in range(4):
        suffix = [rng.randrange(3, 250) for _ in range(rng.randrange(3, 20))]
        prompt = shared + suffix if i % 2 == 0 else suffix + suffix
        seq_id = first_seq_id + i
        requests.append(
            Request(f"r{seq_id}", seq_id, prompt, sampling(temperature=0.0), 16, ignore_eos=True)
        )
    return requests


def run(model: Path, block_size: int) -> tuple[dict[int, list[int]], int, int]:
    """(each request's tokens, preemptions, prefix-cache hit tokens of the last request alone)."""
    engine = Engine(
        EngineConfig(
            model=str(model),
            device="cpu",
            block_size=block_size,
            num_kv_blocks=POOL_TOKENS // block_size,
            max_model_len=POOL_TOKENS,
        )
    )
    scheduler = make_scheduler_for(engine, max_num_batched_tokens=64)
    rng = random.Random(0)
    shared = [rng.randrange(3, 250) for _ in range(SHARED)]
    outputs = dict(drive(scheduler, engine, workload(rng, shared, 0)).outputs)
    counters = scheduler.counters
    preemptions = counters.num_preemptions
    # One more request, alone: its hit is the shared prefix, cut to whole blocks.
    hits_before = counters.num_prefix_cache_hit_tokens
    last = Request("last", 99, [*shared, 7, 8, 9], sampling(temperature=0.0), 8, ignore_eos=True)
    outputs.update(drive(scheduler, engine, [last]).outputs)
    return outputs, preemptions, counters.num_prefix_cache_hit_tokens - hits_before


def test_block_size_1_is_greedy_identical_to_16(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model()
    tokens_16, preemptions_16, hit_16 = run(model, 16)
    tokens_1, preemptions_1, hit_1 = run(model, 1)
    assert preemptions_16 > 0 and preemptions_1 > 0, (preemptions_16, preemptions_1)
    assert tokens_1 == tokens_16
    assert all(len(t) == (8 if seq_id == 99 else 16) for seq_id, t in tokens_1.items())
    # Sharing: whole blocks at 16 (2 of the 40 shared tokens' 2.5 blocks), every shared token at 1.
    assert hit_16 == 32
    assert hit_1 == SHARED


def test_block_tables_kept_between_steps_match_a_fresh_build() -> None:
    """engine/step_inputs.BlockTables copies only what a table gained since the last step, and
    follows a new list for a seq (lookahead blocks given back, a readmission) and a row missing
    for a step."""
    cpu = torch.device("cpu")
    kept = BlockTables()
    a, b = list(range(5)), [40, 41]
    for step in range(40):
        a.append(100 + step)  # one block per token, as at block size 1
        if step % 7 == 3:
            a = a[:-2]  # lookahead blocks given back: a new list, as engine/contract/mirror.py does
        if step == 20:
            b = [7] * 30  # the seq was preempted and readmitted: a new list
        if step % 3 != 1:
            b.append(step)
        rows = [a, b] if step % 11 != 5 else [a]  # b left out of one step
        width = max(len(t) for t in rows) + 2
        assert torch.equal(kept.padded(rows, width, cpu), padded_block_tables(rows, width, cpu))
