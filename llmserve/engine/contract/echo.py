"""A model-free engine that speaks the real step contract, for tests of the scheduler and gateway.

It mirrors requests exactly as the real engine does (same Mirror, same checks) and "samples" by
echoing: output token i is prompt token i mod prompt length, so outputs are deterministic,
batch invariant, survive preemption, and a test picks the text by picking the prompt. Top-k
logprobs are tokens t, t+1, ... with logprobs 0, -1, -2, .... Prompt token j scores logprob
-0.5 * (j % 3) at rank 1 + j % 3 (`_echo_prompt_scores`). EchoEngineConfig's settings
model a device (step delays, P pipeline stages with P steps in flight, speculation) and, with
--engine-role prefill | decode, one side of disaggregation: a pool of tiny blocks
(engine/kv/echo_kv.py) whose transfers run through engine/kv/disaggregation.py as the real
engine's do, over a modelled link (docs/disaggregation.md#a-model-of-the-gpu-case).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.common.flags import setting
from llmserve.common.step_plan import StepOutput, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.contract import EngineInfo, PromptScores, with_refused_rows
from llmserve.engine.contract.mirror import Mirror, MirrorMismatch, ScheduledSeq

if TYPE_CHECKING:
    from llmserve.engine.kv.echo_kv import EchoKV


@dataclass
class EchoStep:
    """A launched fake step: its output, ready at ready_at (time.monotonic())."""

    output: StepOutput
    ready_at: float = 0.0
    seq_ids: frozenset[int] = field(default_factory=frozenset)  # the requests it holds

    @property
    def is_ready(self) -> bool:
        return time.monotonic() >= self.ready_at

    def wait(self) -> None:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))


@dataclass(frozen=True)
class EchoEngineConfig:
    """The echo engine's own settings (`llmserve engine --fake ...`, tests only); the rest come
    from EngineConfig: block_size, num_kv_blocks (0: 256), max_model_len (0: 2048), the step
    limits and the network."""

    vocab_size: int = setting(512, "the echo engine's vocabulary size")
    eos_token_ids: tuple[int, ...] = setting((), "its EOS token ids")
    step_delay_ms: float = setting(0.0, "how long each step occupies the pretend device")
    step_token_delay_ms: float = setting(
        0.0, "and per token the step computes, on top (a CPU's step grows with its tokens)"
    )
    pipeline_parallel_size: int = setting(
        1, "pipeline stages it pretends to have (each step_delay_ms / P; P steps in flight)"
    )
    num_speculative_tokens: int = setting(
        0,
        "speculative decoding it pretends to do: proposals per request and step (the echo, "
        "wrong at every output index i where i mod 3 is 2, so some are rejected)",
    )
    kv_block_bytes: int = setting(
        0,
        "--engine-role prefill|decode: one block's KV bytes it pretends to move (its "
        "EngineInfo.kv_block_bytes, and the modelled link's load; 0: the 8 it really moves)",
    )
    kv_link_gb_per_s: float = setting(
        0.0,
        "--engine-role prefill: the modelled link's bandwidth in GB/s (1e9 bytes): a KV send "
        "leaves one at a time, no earlier than the link is free + its blocks x kv_block_bytes / "
        "bandwidth (0: at once)",
    )

    num_state_slots: int = setting(
        0,
        "recurrent-state slots it pretends to hold, as a hybrid linear-attention model's engine "
        "(EngineInfo.num_state_slots; its mirror checks each new request's state_slot; 0: none)",
    )
    num_state_snapshot_slots: int = setting(
        0,
        "state snapshot slots it pretends to hold after those (EngineInfo."
        "num_state_snapshot_slots: the prefix cache of a hybrid model; its mirror checks the "
        "plans' restores and snapshots; 0: none)",
    )

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={self.pipeline_parallel_size} must be >= 1")
        if self.kv_block_bytes < 0 or self.kv_link_gb_per_s < 0:
            raise ValueError(
                f"kv_block_bytes={self.kv_block_bytes}, kv_link_gb_per_s="
                f"{self.kv_link_gb_per_s}: must be >= 0"
            )


class EchoEngine:
    def __init__(self, config: EngineConfig | None = None, fake: EchoEngineConfig | None = None):
        config = config or EngineConfig()
        fake = fake or EchoEngineConfig()
        num_blocks = config.num_kv_blocks or 256
        self.kv = _echo_kv(config, fake, num_blocks)
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
            max_num_batched_tokens=config.step_tokens("echo"),
            pipeline_parallel_size=fake.pipeline_parallel_size,
            speculative_method="echo" if fake.num_speculative_tokens else "",
            num_speculative_tokens=fake.num_speculative_tokens,
            kv_block_bytes=self.kv.block_bytes if self.kv is not None else 0,
            engine_role=config.engine_role,
            kv_transfer_address=self.kv.address if self.kv is not None else "",
            num_state_slots=fake.num_state_slots,
            num_state_snapshot_slots=fake.num_state_snapshot_slots,
        )
        self.step_delay_ms = fake.step_delay_ms
        self.step_token_delay_ms = fake.step_token_delay_ms
        self.mirror = self._new_mirror()
        self.num_steps = 0
        # When each stage of the "device" finishes the last step launched.
        self.busy_until = [0.0] * fake.pipeline_parallel_size
        self.in_flight: deque[EchoStep] = deque()  # launched, not finished, oldest first

    def reset(self) -> None:
        self.mirror = self._new_mirror()
        self.in_flight.clear()
        if self.kv is not None:
            self.kv.reset()

    def _new_mirror(self) -> Mirror:
        info = self.info
        return Mirror(
            info.block_size, info.num_blocks, info.vocab_size,
            num_state_slots=info.num_state_slots,
            num_state_snapshot_slots=info.num_state_snapshot_slots,
        )  # fmt: skip

    def launch(self, plan: StepPlanData) -> EchoStep:
        """Run plan on the host at once; its result is ready when it has passed every stage:

            stage k starts it at max(stage k-1 done with it, stage k done with the last step)

        (one stage: step_delay_ms after the previous launched step's result, or after now if
        the device is idle). Raises MirrorMismatch when P > 1 and plan holds a request that a
        step in flight holds."""
        seq_ids = frozenset(plan.running.seq_ids) | {r.seq_id for r in plan.new_requests}
        self._check_disjoint(plan.step_id, seq_ids)
        self._transfer(plan)
        step = EchoStep(self._run(plan), seq_ids=seq_ids)
        num_tokens = sum(plan.running.num_scheduled_tokens)
        num_tokens += sum(r.num_scheduled_tokens for r in plan.new_requests)
        delay_ms = self.step_delay_ms + self.step_token_delay_ms * num_tokens
        if delay_ms and step.output.sampled_token_ids:
            step.ready_at = time.monotonic()
            stage_s = delay_ms / 1e3 / len(self.busy_until)
            for stage, busy_until in enumerate(self.busy_until):
                step.ready_at = max(step.ready_at, busy_until) + stage_s
                self.busy_until[stage] = step.ready_at
            step.output.forward_ms = delay_ms
        self.in_flight.append(step)
        return step

    def _check_disjoint(self, step_id: int, seq_ids: frozenset[int]) -> None:
        if len(self.busy_until) == 1:
            return
        for step in self.in_flight:
            if shared := sorted(step.seq_ids & seq_ids):
                raise MirrorMismatch(
                    f"step {step_id} holds seq {shared[0]}, which a step in flight holds "
                    f"(pipeline_parallel_size={len(self.busy_until)} needs disjoint steps)"
                )

    def _transfer(self, plan: StepPlanData) -> None:
        """plan's KV transfer parts, before its step (engine/kv/disaggregation.py); MirrorMismatch
        for any on a colocated engine, as the real one."""
        if self.kv is not None:
            self.kv.launch(plan)
        elif plan.kv_sends or plan.kv_receives or plan.kv_receive_cancels:
            raise MirrorMismatch("the plan lists KV transfers; this engine's role is both")

    def finish(self, step: EchoStep) -> StepOutput:
        """step's output once ready; steps finish in launch order. Disaggregated: with the
        transfers written since the last result, those arrived by now (as Engine.finish)."""
        assert self.in_flight and self.in_flight[0] is step, "fake steps finish in launch order"
        self.in_flight.popleft()
        step.wait()
        if self.kv is not None:
            output = step.output
            output.received_transfer_ids, output.failed_transfer_ids = self.kv.report()
        return step.output

    def step(self, plan: StepPlanData) -> StepOutput:
        return self.finish(self.launch(plan))

    def _run(self, plan: StepPlanData) -> StepOutput:
        batch = self.mirror.apply(plan)
        if self.kv is not None:
            new_ids = {r.seq_id for r in plan.new_requests}
            for row in batch.rows:
                if row.seq.seq_id in new_ids:
                    self.kv.check(row)
                self.kv.write(row)
        tokens = [_echo_tokens(r, self.info.vocab_size) for r in batch.rows]
        if batch.has_lookahead:
            self.mirror.commit_tokens(batch, tokens)
        else:
            self.mirror.commit(batch, [t[0] for t in tokens])
        self.num_steps += 1
        flat = [t for row_tokens in tokens for t in row_tokens]
        rows = [r for r, row_tokens in zip(batch.rows, tokens, strict=True) for _ in row_tokens]
        asked = [r.samples and r.seq.sampling.logprobs for r in rows]
        logprobs = [0.0 if a else float("nan") for a in asked] if any(asked) else None
        output = StepOutput(flat, logprobs, 0.0, 0.0)
        if batch.has_lookahead:
            output.num_draft_tokens = [len(r.draft_token_ids) for r in batch.rows]
            output.num_sampled_tokens = [len(t) for t in tokens]
        if any(r.seq.sampling.top_logprobs for r in batch.rows):
            vocab = self.info.vocab_size
            for row, t in zip(rows, flat, strict=True):
                k = row.seq.sampling.top_logprobs if row.samples else 0
                output.num_top_logprobs.append(k)
                output.top_token_ids += [(t + j) % vocab for j in range(k)]
                output.top_logprobs += [float(-j) for j in range(k)]
        if any(r.seq.prompt_logprobs >= 0 for r in batch.rows):
            _echo_prompt_scores(batch.rows, self.info.vocab_size).add_to(output)
        output = with_refused_rows(output, batch.refusals)
        # The echo engine masks nothing: every grammar it is asked to compile is ready at once.
        output.compiled_seq_ids = [g.seq_id for g in plan.grammar_compiles]
        return output


def _echo_kv(config: EngineConfig, fake: EchoEngineConfig, num_blocks: int) -> EchoKV | None:
    """The pool and transfers of a prefill or decode echo engine (None: colocated)."""
    if config.engine_role == "both":
        return None
    if fake.num_speculative_tokens or fake.pipeline_parallel_size > 1:
        raise ValueError(
            f"engine_role={config.engine_role!r} is built for one stage without speculation; "
            f"num_speculative_tokens={fake.num_speculative_tokens}, pipeline_parallel_size="
            f"{fake.pipeline_parallel_size}"
        )
    from llmserve.engine.kv.echo_kv import EchoKV  # torch: only for a role

    return EchoKV(config, num_blocks, fake.kv_block_bytes, fake.kv_link_gb_per_s)


def _echo_prompt_scores(rows: list[ScheduledSeq], vocab_size: int) -> PromptScores:
    """The rows' prompt scores as engine/step/prompt_logprobs.py counts positions: prompt token
    j (j >= 1) has logprob -0.5 * (j % 3) and rank 1 + j % 3; the top-k around it (token
    t - j % 3 + m at logprob -0.5 * m) holds it at that rank."""
    scores = PromptScores([])
    for row in rows:
        seq, k = row.seq, row.seq.prompt_logprobs
        positions = range(row.start, min(row.end, seq.num_prompt_tokens - 1)) if k >= 0 else []
        scores.counts.append(len(positions))
        for p in positions:
            j, t = p + 1, seq.token_ids[p + 1]
            scores.logprobs.append(-0.5 * (j % 3))
            scores.ranks.append(1 + j % 3)
            scores.top_token_ids += [(t - j % 3 + m) % vocab_size for m in range(k)]
            scores.top_logprobs += [-0.5 * m for m in range(k)]
    return scores


def _echo_tokens(row: ScheduledSeq, vocab_size: int) -> list[int]:
    """row's tokens: [-1] mid-prefill; else the echo (output i = prompt token i mod its length),
    after proposing its lookahead slots' worth of it, wrong where i % 3 == 2, and accepting
    proposals up to the first wrong one (the echo follows it, so the output is the same)."""
    if not row.samples:
        return [-1]
    seq = row.seq

    def echo(i: int) -> int:
        return seq.token_ids[i % seq.num_prompt_tokens]

    n = seq.num_output_tokens
    row.draft_token_ids = [
        echo(i) if i % 3 != 2 else (echo(i) + 1) % vocab_size
        for i in range(n, n + row.num_lookahead_tokens)
    ]
    tokens = []
    for i, proposed in enumerate(row.draft_token_ids, start=n):
        tokens.append(echo(i))
        if proposed != echo(i):
            return tokens
    return [*tokens, echo(n + len(row.draft_token_ids))]
