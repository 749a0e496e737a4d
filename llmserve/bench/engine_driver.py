"""Drives an Engine in-process, for tests and benchmarks: `Driver` plays the scheduler (every prompt
admitted whole in the first step, then one decode token per request per step, KV blocks handed
out in order)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from llmserve.common.sampling import normalized
from llmserve.common.step_plan import LoraLoad, NewRequest, RunningColumns, StepOutput, StepPlanData
from llmserve.engine.step.engine import Engine
from llmserve.protos.common_pb2 import SamplingParams

GREEDY = normalized(SamplingParams(temperature=0.0))


def blocks_needed(prompt_lens: list[int], num_tokens: int, block_size: int) -> int:
    """KV blocks a Driver takes for these prompts and num_tokens new tokens each."""
    return sum(-(-(n + num_tokens) // block_size) for n in prompt_lens)


class Driver:
    """`start` admits the prompts (the engine is reset first); each `decode` computes one more
    token of every request. `generated[i]` holds request i's sampled tokens."""

    def __init__(self, engine: Engine, sampling: SamplingParams = GREEDY):
        self.engine = engine
        self.sampling = sampling
        self.block_size = engine.config.block_size
        self.next_block = 0
        self.step_id = 0
        self.tables: list[list[int]] = []
        self.computed: list[int] = []
        self.generated: list[list[int]] = []
        self.lora_slots: list[int] = []

    def _grow(self, seq_id: int, length: int) -> list[int]:
        need = -(-length // self.block_size) - len(self.tables[seq_id])
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        self.tables[seq_id] += new
        return new

    def _step(
        self,
        new: list[NewRequest],
        running: RunningColumns,
        lora_loads: list[LoraLoad] | None = None,
    ) -> StepOutput:
        self.step_id += 1
        out = self.engine.step(StepPlanData(self.step_id, [], new, running, lora_loads or []))
        for i, token in enumerate(out.sampled_token_ids):
            self.generated[i].append(token)
        return out

    def start(
        self,
        prompts: list[list[int]],
        lora_slots: list[int] | None = None,
        lora_loads: list[LoraLoad] | None = None,
    ) -> StepOutput:
        """lora_slots: each request's adapter slot (0: the base; None: no adapters), loaded
        by lora_loads in this first step."""
        self.engine.reset()
        self.lora_slots = list(lora_slots or [])
        new = []
        for seq_id, prompt in enumerate(prompts):
            self.tables.append([])
            self.generated.append([])
            table = self._grow(seq_id, len(prompt))  # a copy of the whole (new) table
            slot = self.lora_slots[seq_id] if self.lora_slots else 0
            n = len(prompt)
            new.append(  # state slot seq_id: a hybrid model's (ignored by others)
                NewRequest(seq_id, prompt, n, self.sampling, table, 0, n, slot, seq_id)
            )
        self.computed = [len(p) for p in prompts]
        return self._step(new, RunningColumns([], [], [], [], []), lora_loads or [])

    def decode(self) -> StepOutput:
        num_seqs = len(self.computed)
        new_blocks = [self._grow(i, self.computed[i] + 1) for i in range(num_seqs)]
        running = RunningColumns(
            seq_ids=list(range(num_seqs)),
            num_scheduled_tokens=[1] * num_seqs,
            num_computed_tokens=list(self.computed),
            num_new_blocks=[len(b) for b in new_blocks],
            new_block_ids=[b for blocks in new_blocks for b in blocks],
            lora_slot=self.lora_slots,
        )
        out = self._step([], running)
        self.computed = [n + 1 for n in self.computed]
        return out


def generate(
    engine: Engine,
    prompts: list[list[int]],
    num_tokens: int,
    sampling: SamplingParams = GREEDY,
) -> list[list[int]]:
    """num_tokens sampled tokens per prompt, all prompts in one batch (the first step prefills
    them all, each later step decodes one token of each). The engine is reset first."""
    driver = Driver(engine, sampling)
    driver.start(prompts)
    for _ in range(num_tokens - 1):
        driver.decode()
    return driver.generated


def time_decode_steps(
    engine: Engine,
    batch: int,
    num_steps: int,
    prompt_len: int = 128,
    warmed: Callable[[], None] | None = None,
    prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The decode step time of batch requests (prompts of prompt_len tokens, admitted whole; or
    the prompts given): 3 decode steps to warm up (then warmed(), if given), then num_steps
    timed ones. Returns step_row's figures."""
    driver = Driver(engine)
    driver.start(prompts or [[100 + i] * (prompt_len - 1) + [5] for i in range(batch)])
    for _ in range(3):
        driver.decode()
    if warmed is not None:
        warmed()
    times = []
    for _ in range(num_steps):
        t0 = time.perf_counter()
        driver.decode()
        times.append((time.perf_counter() - t0) * 1e3)
    return step_row(batch, times, driver.generated[0][:8])


def step_row(batch: int, times_ms: list[float], first_tokens: list[int]) -> dict[str, Any]:
    """A timed batch's figures: the batch, the median and every step's milliseconds, tokens
    per second at the median and request 0's first tokens."""
    median = statistics.median(times_ms)
    return {
        "batch": batch,
        "step_ms_median": round(median, 2),
        "step_ms": [round(t, 2) for t in times_ms],
        "tokens_per_s": round(batch * 1e3 / median, 1),
        "first_tokens": first_tokens,
    }
