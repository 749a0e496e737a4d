"""The engine's side of the step contract beyond the plan: what the engine reports of itself
(EngineInfo), the rows it refuses (Refusal, with_refused_rows) and the prompt scores it returns
(PromptScores, engine/step/prompt_logprobs.py). The plan and the result are
common/step_plan.py's (both sides use them); engine/contract/convert.py turns these into protobuf.
Why structured output and grammar compiles travel as they do:
docs/architecture.md#structured-output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmserve.common.step_plan import StepOutput


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    # The largest step the engine is sized for (memory profile, CUDA graphs).
    max_num_seqs: int
    max_num_batched_tokens: int
    # Ranks per pipeline stage, and stages: the scheduler keeps up to pipeline_parallel_size
    # steps in flight, holding disjoint requests.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Speculative decoding: how the engine proposes tokens ("" for none), and at most how many
    # per request and step (the scheduler's lookahead slots).
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    # The window when every layer is windowed (0: none): the scheduler releases a request's
    # blocks wholly before it.
    sliding_window: int = 0
    # LoRA: device slots for adapters (at most this many distinct adapters per step; 0: none)
    # and the highest rank accepted.
    max_loras: int = 0
    max_lora_rank: int = 0
    # KV offload: the host and disk tiers' slots, one block each (0: no such tier).
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    kv_block_bytes: int = 0
    # Disaggregation (--engine-role): prefill, decode or both; where a decode engine takes KV
    # transfers (host:port; "" otherwise).
    engine_role: str = "both"
    kv_transfer_address: str = ""
    # Hybrid linear-attention models: the state pool's slots (0: no state layers); each running
    # request holds one (NewRequest.state_slot).
    num_state_slots: int = 0
    # Their snapshot slots after them (--state-snapshot-slots; 0: none, no prefix cache).
    num_state_snapshot_slots: int = 0


@dataclass(frozen=True)
class Refusal:
    """A plan row the engine does not run: a new request it refused (reason), or a later row of
    one (reason None: reported already)."""

    row: int
    seq_id: int
    reason: str | None


@dataclass
class PromptScores:
    """One step's prompt scores, as StepResult carries them: per batch row, how many positions
    it scored; per position, the next token's logprob and rank, and its row's top-k."""

    counts: list[int]
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)

    def add_to(self, output: StepOutput) -> None:
        """Set output's prompt logprob columns (output has one row per batch row)."""
        output.num_prompt_logprobs = self.counts
        output.prompt_logprobs = self.logprobs
        output.prompt_logprob_ranks = self.ranks
        output.prompt_top_token_ids = self.top_token_ids
        output.prompt_top_logprobs = self.top_logprobs


def with_refused_rows(output: StepOutput, refusals: list[Refusal]) -> StepOutput:
    """output (one row per batch row) with the refused rows put back at their plan rows: no
    token, NaN logprob, no top logprobs; the refusals with a reason listed."""
    if not refusals:
        return output
    tokens, logprobs = list(output.sampled_token_ids), output.logprobs
    counts = list(output.num_top_logprobs)
    num_prompt = list(output.num_prompt_logprobs)
    drafts, num_sampled = list(output.num_draft_tokens), list(output.num_sampled_tokens)
    for refusal in sorted(refusals, key=lambda r: r.row):
        at = refusal.row if not num_sampled else sum(num_sampled[: refusal.row])
        tokens.insert(at, -1)
        if logprobs is not None:
            logprobs = [*logprobs[:at], math.nan, *logprobs[at:]]
        if counts:
            counts.insert(at, 0)
        if num_prompt:
            num_prompt.insert(refusal.row, 0)
        if num_sampled:
            num_sampled.insert(refusal.row, 1)
            drafts.insert(refusal.row, 0)
    refused = [r for r in refusals if r.reason is not None]
    result = StepOutput(
        tokens, logprobs, output.forward_ms, output.sample_ms, counts,
        output.top_token_ids, output.top_logprobs,
        [r.seq_id for r in refused], [r.reason or "" for r in refused], drafts, num_sampled,
    )  # fmt: skip
    result.num_prompt_logprobs = num_prompt
    result.prompt_logprobs, result.prompt_logprob_ranks = (
        output.prompt_logprobs,
        output.prompt_logprob_ranks,
    )
    result.prompt_top_token_ids = output.prompt_top_token_ids
    result.prompt_top_logprobs = output.prompt_top_logprobs
    return result
