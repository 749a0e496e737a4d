"""A step as the scheduler plans it (StepPlan: rows of new and running requests, made by
`make_plan` from the requests scheduled) and what it produced (StepOutcome per request,
TopLogprobColumns, PromptScoreColumns). scheduler/service/convert.py turns a plan into the
engine's message, each row field into the engine.proto field of its name, and the engine's
result into these."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice

from llmserve.common.step_plan import BlockCopies, KVReceive, KVSend, LoraLoad
from llmserve.scheduler.request import PromptScore, Request, RequestStatus


@dataclass
class NewRequestRow:
    request: Request
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    # Set by _make_plan: whether the step completes the request's tokens (its sample is kept),
    # and the request's num_preemptions then (a result for an earlier life is ignored).
    samples: bool = False
    num_preemptions: int = 0
    # The adapter slot it runs under (1 .. the engine's max_loras; 0: the base model).
    lora_slot: int = 0
    # The engine's state slot its recurrent state lives in (scheduler/state_slots.py; 0 for a
    # model without state layers).
    state_slot: int = 0
    # Whether the engine scores its prompt positions (its prompt logprobs are not all in).
    prompt_logprobs: bool = False
    # A prefix-cache hit's snapshot slot its state is restored from (0: none; state_slots.py).
    state_restore_from: int = 0


@dataclass
class RunningRow:
    request: Request
    num_scheduled_tokens: int
    num_computed_tokens: int
    new_block_ids: list[int]
    samples: bool = False  # as in NewRequestRow
    num_preemptions: int = 0
    # Speculative decoding: KV slots after the scheduled tokens for the engine's proposals.
    num_lookahead_tokens: int = 0
    lora_slot: int = 0  # as in NewRequestRow; named every step


@dataclass(frozen=True)
class SnapshotTaken:
    """A hybrid model's state snapshot a plan takes after its forward: request's state slot
    from_slot (its row ends at the block of hash block_hash) into snapshot slot to_slot; good
    once the plan's result is in while the request still runs in the same life."""

    request: Request
    num_preemptions: int
    block_hash: int
    from_slot: int
    to_slot: int


@dataclass
class StepPlan:
    """One step for the engine. Batch order: new_requests, then running."""

    step_id: int
    finished_seq_ids: list[int]
    new_requests: list[NewRequestRow] = field(default_factory=list)
    running: list[RunningRow] = field(default_factory=list)
    # Requests preempted while planning this step (their ids are in finished_seq_ids).
    preempted: list[Request] = field(default_factory=list)
    # Adapters the engine places in slots before the rows run.
    lora_loads: list[LoraLoad] = field(default_factory=list)
    # KV offload: copies between tiers, in the order the engine runs them (kv_offload.py).
    kv_copies: list[BlockCopies] = field(default_factory=list)
    # Structured output: held requests whose grammar the engine is to compile (their
    # constraints travel in the plan), and whether some sent earlier are not reported yet (the
    # plan then goes even with nothing else in it, to ask; scheduler/grammar_wait.py).
    grammar_compiles: list[Request] = field(default_factory=list)
    asks_grammars: bool = False
    # Disaggregation (scheduler/disagg/handoffs.py): transfers to send, to await, and ids given up;
    # whether transfers are awaited (a plan then goes out even with nothing else in it: the
    # engine is polled).
    kv_sends: list[KVSend] = field(default_factory=list)
    kv_receives: list[KVReceive] = field(default_factory=list)
    kv_receive_cancels: list[int] = field(default_factory=list)
    awaits_transfers: bool = False
    # State snapshots taken after this step's forward (scheduler/state_slots.py).
    state_snapshots: list[SnapshotTaken] = field(default_factory=list)

    @property
    def rows(self) -> list[NewRequestRow | RunningRow]:
        return [*self.new_requests, *self.running]

    @property
    def requests(self) -> list[Request]:
        return [r.request for r in self.rows]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        return not (
            self.new_requests or self.running or self.finished_seq_ids or self.kv_copies
            or self.grammar_compiles or self.asks_grammars
            or self.kv_sends or self.kv_receives or self.kv_receive_cancels
            or self.awaits_transfers
        )  # fmt: skip


@dataclass
class StepOutcome:
    """What a step produced for one request: its new token and whether it finished (token_id is
    None for a request ended without a token: aborted, or dropped by a resize)."""

    request: Request
    token_id: int | None
    logprob: float | None
    finished: RequestStatus | None
    # Why the request ended without finishing (the engine refused it): its stream fails with it.
    error: str | None = None
    # The request's top_logprobs most likely tokens at this position, when it asked.
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass
class TopLogprobColumns:
    """A step's top logprobs: counts[i] entries for plan row i, row after row, best first."""

    counts: list[int]
    token_ids: list[int]
    logprobs: list[float]

    def rows(self) -> list[tuple[list[int], list[float]]]:
        """Each row's (token ids, logprobs)."""
        token_ids, logprobs = iter(self.token_ids), iter(self.logprobs)
        return [(list(islice(token_ids, n)), list(islice(logprobs, n))) for n in self.counts]


@dataclass
class PromptScoreColumns:
    """A step's prompt scores (engine.proto's StepResult): counts[i] positions for plan row i;
    per position a logprob, a rank and its row's top-k entries, row after row."""

    counts: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[int]
    top_logprobs: list[float]

    def rows(self, top_ks: list[int]) -> list[list[PromptScore]]:
        """Each row's scores, given each row's number of top entries per position."""
        lps, ranks = iter(self.logprobs), iter(self.ranks)
        top_ids, top_lps = iter(self.top_token_ids), iter(self.top_logprobs)
        rows: list[list[PromptScore]] = []
        for n, k in zip(self.counts, top_ks, strict=True):
            rows.append([])
            for _ in range(n):
                top = list(islice(top_ids, k)), list(islice(top_lps, k))
                rows[-1].append(PromptScore(next(lps), next(ranks), *top))
        return rows


def make_plan(
    step_id: int,
    finished_seq_ids: list[int],
    preempted: list[Request],
    scheduled: list[tuple[Request, int]],
) -> StepPlan:
    """Step step_id's plan for `scheduled` (request, tokens now): a row per request, new to the
    engine or running (scheduler/service/convert.py sends each row field as the .proto field of its
    name). Advances each request as the engine will:

        before: |<- num_computed_tokens ->|<- num_new ->|<- rest ->|
        after:  |<- num_computed_tokens -------------->|<- rest ->|

    and when rest is empty the step samples: a pending token joins num_tokens."""
    plan = StepPlan(step_id, finished_seq_ids, preempted=preempted)
    for request, num_new in scheduled:
        row: NewRequestRow | RunningRow
        if not request.mirror.in_engine:
            row = NewRequestRow(
                request,
                list(request.token_ids),
                list(request.block_table),
                request.num_computed_tokens,
                num_new,
                state_slot=request.state_slot or 0,
                state_restore_from=request.state_restore_from,
                prompt_logprobs=request.needs_prompt_logprobs,
            )
            plan.new_requests.append(row)
            request.mirror.in_engine = True
        else:
            new_blocks = request.block_table[request.mirror.num_sent_blocks :]
            row = RunningRow(request, num_new, request.num_computed_tokens, new_blocks)
            row.num_lookahead_tokens, request.spec.num_lookahead_tokens = (
                request.spec.num_lookahead_tokens,
                0,
            )
            plan.running.append(row)
        request.mirror.num_sent_blocks = len(request.block_table)
        request.pipeline.last_step_id = plan.step_id
        request.num_computed_tokens += num_new
        row.samples = request.num_computed_tokens == request.num_tokens
        row.num_preemptions = request.num_preemptions
        request.num_pending_tokens += row.samples
    return plan


def take_prompt_scores(plan: StepPlan, columns: PromptScoreColumns) -> None:
    """Append each row's prompt scores (plan's result, taken before `update` takes its
    tokens) to its request's (prompt_scores[j]: prompt token j + 1's), skipping those it
    has (a recompute after a preemption scores its prompt again) and rows of an earlier
    life. A row's scores start at its first scheduled position:

        prompt_scores: |<- have ------------------>|
        row's scores:          |<- num_computed_tokens ... ->|  (kept: from `have` on)
    """
    top_ks = [r.request.prompt_top_logprobs for r in plan.rows]
    for row, scores in zip(plan.rows, columns.rows(top_ks), strict=True):
        request = row.request
        if not scores or request.num_preemptions != row.num_preemptions:
            continue
        have = len(request.prompt_scores)
        assert row.num_computed_tokens <= have, (
            f"{request.request_id}: prompt scores from {row.num_computed_tokens}, {have} in"
        )
        request.prompt_scores += scores[have - row.num_computed_tokens :]
