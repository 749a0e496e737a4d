"""A model-free engine that speaks the real step contract, for tests of the scheduler and gateway.

It mirrors requests exactly as the real engine does (same Mirror, same checks) and "samples" by
echoing: output token i is prompt token i mod prompt length. Outputs are deterministic, batch
invariant and survive preemption, and a test controls the text by choosing the prompt.
"""

from __future__ import annotations

import time

from engine.engine import EngineInfo
from engine.mirror import Mirror, StepPlanData
from engine.runner import StepOutput


class FakeEngine:
    def __init__(
        self,
        vocab_size: int = 512,
        max_model_len: int = 2048,
        block_size: int = 16,
        num_blocks: int = 256,
        eos_token_ids: tuple[int, ...] = (),
        step_delay_ms: float = 0.0,
    ):
        self.info = EngineInfo(
            "fake-echo",
            vocab_size,
            max_model_len,
            eos_token_ids,
            block_size,
            num_blocks,
            "cpu",
            "none",
        )
        self.step_delay_ms = step_delay_ms
        self.mirror = Mirror(block_size, num_blocks)
        self.num_steps = 0

    def reset(self) -> None:
        self.mirror = Mirror(self.info.block_size, self.info.num_blocks)

    def step(self, plan: StepPlanData) -> StepOutput:
        batch = self.mirror.apply(plan)
        if self.step_delay_ms:
            time.sleep(self.step_delay_ms / 1e3)
        tokens = []
        for row in batch.rows:
            seq = row.seq
            index = seq.num_output_tokens % seq.num_prompt_tokens
            tokens.append(seq.token_ids[index] if row.samples else -1)
        self.mirror.commit(batch, tokens)
        self.num_steps += 1
        any_logprobs = any(r.seq.sampling.logprobs for r in batch.rows)
        logprobs = [0.0 if t >= 0 else float("nan") for t in tokens] if any_logprobs else None
        return StepOutput(tokens, logprobs, 0.0, 0.0)
