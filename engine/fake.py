"""A model-free engine that speaks the real step contract, for tests of the scheduler and gateway.

It mirrors requests exactly as the real engine does (same Mirror, same checks) and "samples" by
echoing: output token i is prompt token i mod prompt length. Outputs are deterministic, batch
invariant and survive preemption, and a test controls the text by choosing the prompt.
Logprobs are 0.0 for the echoed token; top-k logprobs are tokens t, t+1, ... (mod the vocabulary)
with logprobs 0, -1, -2, ...

step_delay_ms models a device: each step occupies it that long, steps run back to back in launch
order, and `launch` returns at once (as the real engine's does on a GPU) with a step whose
result is ready when its turn on the "device" ends; `step` waits for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from common.flags import setting
from engine.config import EngineConfig
from engine.contract import EngineInfo, StepOutput, StepPlanData, with_refused_rows
from engine.mirror import Mirror


@dataclass
class FakeStep:
    """A launched fake step: its output, ready at ready_at (time.monotonic())."""

    output: StepOutput
    ready_at: float = 0.0

    @property
    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def wait(self) -> None:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))


@dataclass(frozen=True)
class FakeEngineConfig:
    """The echo engine's own settings (`llmserve engine --fake ...`, tests only); the rest come
    from EngineConfig: block_size, num_kv_blocks (0: 256), max_model_len (0: 2048), the step
    limits and the network."""

    vocab_size: int = setting(512, "the echo engine's vocabulary size")
    eos_token_ids: tuple[int, ...] = setting((), "its EOS token ids")
    step_delay_ms: float = setting(0.0, "how long each step occupies the pretend device")


class FakeEngine:
    def __init__(self, config: EngineConfig | None = None, fake: FakeEngineConfig | None = None):
        config = config or EngineConfig()
        fake = fake or FakeEngineConfig()
        num_blocks = config.num_kv_blocks or 256
        self.info = EngineInfo(
            model="fake-echo",
            vocab_size=fake.vocab_size,
            max_model_len=config.max_model_len or 2048,
            eos_token_ids=fake.eos_token_ids,
            block_size=config.block_size,
            num_blocks=num_blocks,
            device="cpu",
            dtype="none",
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.step_delay_ms = fake.step_delay_ms
        self.mirror = Mirror(config.block_size, num_blocks, fake.vocab_size)
        self.num_steps = 0
        self.busy_until = 0.0  # when the "device" finishes the last launched step

    def reset(self) -> None:
        self.mirror = Mirror(self.info.block_size, self.info.num_blocks, self.info.vocab_size)

    def launch(self, plan: StepPlanData) -> FakeStep:
        """Run plan on the host at once; its result is ready step_delay_ms after the previous
        launched step's (or now, if the device is idle)."""
        output = self._run(plan)
        if not self.step_delay_ms or not output.sampled_token_ids:
            return FakeStep(output)
        self.busy_until = max(self.busy_until, time.monotonic()) + self.step_delay_ms / 1e3
        output.forward_ms = self.step_delay_ms
        return FakeStep(output, self.busy_until)

    def finish(self, step: FakeStep) -> StepOutput:
        step.wait()
        return step.output

    def step(self, plan: StepPlanData) -> StepOutput:
        return self.finish(self.launch(plan))

    def _run(self, plan: StepPlanData) -> StepOutput:
        batch = self.mirror.apply(plan)
        tokens = [
            r.seq.token_ids[r.seq.num_output_tokens % r.seq.num_prompt_tokens] if r.samples else -1
            for r in batch.rows
        ]
        self.mirror.commit(batch, tokens)
        self.num_steps += 1
        asked = [r.samples and r.seq.sampling.logprobs for r in batch.rows]
        logprobs = [0.0 if a else float("nan") for a in asked] if any(asked) else None
        output = StepOutput(tokens, logprobs, 0.0, 0.0)
        if any(r.seq.sampling.top_logprobs for r in batch.rows):
            vocab = self.info.vocab_size
            for row, t in zip(batch.rows, tokens, strict=True):
                k = row.seq.sampling.top_logprobs if row.samples else 0
                output.num_top_logprobs.append(k)
                output.top_token_ids += [(t + j) % vocab for j in range(k)]
                output.top_logprobs += [float(-j) for j in range(k)]
        return with_refused_rows(output, batch.refusals)
