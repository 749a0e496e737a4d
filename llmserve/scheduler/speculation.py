"""How many tokens the engine may propose for a request (its lookahead slots), and the counts
of what it proposed and what was accepted.

The engine proposes and verifies (engine/features/proposer.py, engine/step/runner.py); the scheduler
decides how far each request may look ahead. Verifying d proposals costs a step d more tokens of
work, which pays only while enough of them are accepted. So the policy backs off per request: it
keeps an exponential moving average of the request's acceptance rate over the steps that proposed
something, and when it falls below MIN_ACCEPTANCE, the request decodes without lookahead for
FIRST_BACKOFF_STEPS steps, then tries again (a probe); each probe that fails doubles the wait, up to
MAX_BACKOFF_STEPS. A step whose proposer found nothing (no n-gram match) costs nothing extra and
leaves the average alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llmserve.scheduler.request import Request

# Below this acceptance rate (accepted / proposed), back off. On the 2-core CPU a step verifying
# (mostly) 4 proposals took about 1.6 times a one-token step (bench/results/spec_cpu.json, n-gram
# on the copy workload: 50-56 ms against 33 ms), so it pays from about 0.15 (0.6 tokens accepted
# per step); 0.35 keeps a margin for machines where verification costs more.
MIN_ACCEPTANCE = 0.35
# Weight of the newest step in the moving average.
EMA_WEIGHT = 0.5
FIRST_BACKOFF_STEPS = 8
MAX_BACKOFF_STEPS = 256


@dataclass
class SpecCounters:
    """Cumulative counts since start: rows the engine proposed tokens for, tokens proposed and
    accepted, and per proposal position (0 first) the same two."""

    num_spec_rows: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_spec_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def add(self, num_draft: int, num_accepted: int) -> None:
        """Count one row's proposals: num_draft proposed, the first num_accepted accepted."""
        if num_draft == 0:
            return
        self.num_spec_rows += 1
        self.num_spec_draft_tokens += num_draft
        self.num_spec_accepted_tokens += num_accepted
        for counts, n in (
            (self.num_spec_draft_tokens_per_pos, num_draft),
            (self.num_spec_accepted_tokens_per_pos, num_accepted),
        ):
            counts.extend([0] * (num_draft - len(counts)))
            for j in range(n):
                counts[j] += 1


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int):
        """num_speculative_tokens: the engine's most per request and step (0: no speculation)."""
        assert num_speculative_tokens >= 0
        self.num_speculative_tokens = num_speculative_tokens

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def lookahead(self, request: Request, limit: int) -> int:
        """Lookahead slots for request's next decode step, at most limit (what its max_tokens,
        the context and the step's token budget leave). A backed-off request counts the step."""
        if self.num_speculative_tokens == 0 or request.disable_speculation or limit <= 0:
            return 0
        if request.needs_prompt_logprobs:  # its last prefill chunk: scored, not speculated
            return 0
        if request.spec.steps_to_skip > 0:
            request.spec.steps_to_skip -= 1
            return 0
        return min(self.num_speculative_tokens, limit)

    def on_result(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Fold a step's proposals for request (num_draft made, num_accepted of them accepted)
        into its moving average; back off when it is too low."""
        if num_draft == 0:
            return
        rate = num_accepted / num_draft
        request.spec.acceptance += EMA_WEIGHT * (rate - request.spec.acceptance)
        if request.spec.acceptance >= MIN_ACCEPTANCE:
            request.spec.backoff_steps = 0
            return
        backoff = min(2 * request.spec.backoff_steps or FIRST_BACKOFF_STEPS, MAX_BACKOFF_STEPS)
        request.spec.backoff_steps = request.spec.steps_to_skip = backoff
        # A probe that does well brings it back at once.
        request.spec.acceptance = MIN_ACCEPTANCE
