"""The engine's mirror of the scheduler's running requests, and the checks that keep it honest.

The scheduler decides; the mirror only follows. Each plan drops finished requests, adds new ones in
full, and applies the running rows' deltas. Any disagreement (an unknown id, a computed-token count
that differs, a block table too short for the scheduled tokens) raises MirrorMismatch, which the
service turns into FAILED_PRECONDITION. No torch here.

Steps are committed in order, each before the next plan is applied. With overlap a step may be
committed before its tokens reach the host (`commit_pending`: a PLACEHOLDER noting the step and
row that sampled it; `resolve` writes the real token). A speculative step, whose rows carry
proposals, is resolved before the next one is applied (`commit_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.common.plan_columns import BLOCK_COUNT_COLUMN, VALUE_COLUMNS
from llmserve.common.sampling import normalized
from llmserve.common.step_plan import NewRequest, StepPlanData
from llmserve.engine.contract.contract import Refusal
from llmserve.protos.common_pb2 import SamplingParams

# The running columns of one value per row (common/plan_columns.py).
PER_ROW_COLUMNS = (*VALUE_COLUMNS, BLOCK_COUNT_COLUMN)

# A sampled token not read back from the device yet (see commit_pending).
PLACEHOLDER = -1


class MirrorMismatch(Exception):
    """A plan disagrees with what the engine holds."""


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    # When token_ids[-1] is PLACEHOLDER: the step and batch row that sampled it (else 0, -1).
    pending_step_id: int = 0
    pending_row: int = -1
    # With a separate draft model (engine.proposer.DraftModelProposer): its own computed tokens,
    # how many of token_ids' first tokens its KV pool holds K/V for. 0 for a request new to
    # the engine (a prefix cache hit or a recompute included): the draft's pool is not the
    # scheduler's, so nothing there is known to be valid.
    num_draft_computed_tokens: int = 0
    # Structured output: the request's grammar matcher (engine/features/grammar.py's RowGrammar),
    # made when it is first scheduled; it goes with the request (a recompute starts a new one).
    grammar: Any = None
    # The adapter slot it runs under this step (0: the base model); the plan names it each step.
    lora_slot: int = 0
    # The state pool's slot of its recurrent state (a model with state layers; else 0).
    state_slot: int = 0
    # Prompt logprobs asked (NewRequest.prompt_logprobs): -1 none, else the top-k per position.
    prompt_logprobs: int = -1

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class ScheduledSeq:
    """One request's share of a step: tokens [start, start + num_scheduled_tokens)."""

    seq: SeqState
    start: int
    num_scheduled_tokens: int
    # Whether this step completes the request's tokens, so its sample is kept (one token rule).
    samples: bool
    # KV slots after `end` the engine may fill with proposed tokens, and the tokens it proposed
    # (at most that many; the proposer sets them before the step runs).
    num_lookahead_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # A token tree's parent index per proposal (engine/features/token_tree.py); [] for a chain.
    # Verification leaves the accepted path here as a chain.
    draft_parents: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        """The end of the known tokens this step computes (proposals come after it)."""
        return self.start + self.num_scheduled_tokens


@dataclass
class StepBatch:
    step_id: int
    rows: list[ScheduledSeq] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)  # plan rows not in `rows`

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled_tokens + len(r.draft_token_ids) for r in self.rows)

    @property
    def has_lookahead(self) -> bool:
        return any(r.num_lookahead_tokens for r in self.rows)


class Mirror:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        vocab_size: int = 0,
        sliding_window: int = 0,
        num_state_slots: int = 0,
        num_state_snapshot_slots: int = 0,
    ):
        """vocab_size: token ids of new requests must be below it (0: unchecked).
        num_state_slots: the state pool's slots (a model with state layers; 0: none): a new
        request names a free one and starts from no computed token, unless it is restored from
        one of the num_state_snapshot_slots after them (a prefix-cache hit).
        sliding_window: the window the scheduler releases blocks out of (EngineInfo's; 0: none):
        a released block may come back to the same request later."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.sliding_window = sliding_window
        self.num_state_slots = num_state_slots
        self.num_state_snapshot_slots = num_state_snapshot_slots
        self.seqs: dict[int, SeqState] = {}
        # New requests refused for what they carry (bad sampling params, token ids outside the
        # vocabulary), by seq id, until the scheduler lists them as finished: the step runs
        # without them, and their later rows sample nothing.
        self.refused: set[int] = set()
        self.last_step_id = 0

    def apply(self, plan: StepPlanData, failed_slots: dict[int, str] | None = None) -> StepBatch:
        """Bring the mirror up to date with plan and return the step's batch, in plan order.
        failed_slots: LoRA slots whose adapter did not load, and why: their rows are refused.
        On MirrorMismatch the mirror may be half-updated; the stream is then reset anyway."""
        if plan.step_id <= self.last_step_id:
            raise MirrorMismatch(f"step_id {plan.step_id} after {self.last_step_id}")
        self.last_step_id = plan.step_id
        for seq_id in plan.finished_seq_ids:
            if seq_id in self.refused:
                self.refused.discard(seq_id)
            elif self.seqs.pop(seq_id, None) is None:
                raise MirrorMismatch(f"finished seq {seq_id} is not in the mirror")
        self._check_state_snapshots(plan)
        listed = [n.seq_id for n in plan.new_requests] + plan.running.seq_ids
        if len(set(listed)) != len(listed):
            raise MirrorMismatch("a seq id is listed twice in one plan")
        failed = failed_slots or {}
        batch = StepBatch(plan.step_id)
        for row, new in enumerate(plan.new_requests):
            # What a request carries (not how it was planned: that is a MirrorMismatch) can
            # make it unrunnable; it is refused alone, whatever else is in the step.
            try:
                sampling = normalized(new.sampling)
                self._check_vocabulary(new)
                _check_lora_slot(new.lora_slot, failed)
            except ValueError as err:
                self.refused.add(new.seq_id)
                batch.refusals.append(Refusal(row, new.seq_id, str(err)))
                continue
            batch.rows.append(self._add(new, sampling))
        self._apply_running(plan, batch, failed)
        return batch

    def _apply_running(self, plan: StepPlanData, batch: StepBatch, failed: dict[int, str]) -> None:
        """The running rows' deltas into the mirror and their rows into batch."""
        run = plan.running
        lookahead, lora_slots = run.column("num_lookahead_tokens"), run.column("lora_slot")
        if any(len(run.column(c)) != len(run.seq_ids) for c in PER_ROW_COLUMNS):
            raise MirrorMismatch("running columns differ in length")
        offset = 0
        for i, seq_id in enumerate(run.seq_ids):
            row = len(plan.new_requests) + i
            if seq_id in self.refused:  # planned before the scheduler heard of the refusal
                offset += run.num_new_blocks[i]
                batch.refusals.append(Refusal(row, seq_id, None))
                continue
            seq = self.seqs.get(seq_id)
            if seq is None:
                raise MirrorMismatch(f"running seq {seq_id} is not in the mirror")
            if seq.num_computed_tokens != run.num_computed_tokens[i]:
                raise MirrorMismatch(
                    f"seq {seq_id}: plan says {run.num_computed_tokens[i]} computed tokens, "
                    f"mirror has {seq.num_computed_tokens}"
                )
            count = run.num_new_blocks[i]
            seq.block_table.extend(
                self._checked_blocks(
                    seq_id, run.new_block_ids[offset : offset + count], self._held_blocks(seq)
                )
            )
            offset += count
            if lora_slots[i] in failed:  # its adapter did not load: it cannot run
                self.refused.add(seq_id)
                self.seqs.pop(seq_id)
                batch.refusals.append(Refusal(row, seq_id, failed[lora_slots[i]]))
                continue
            seq.lora_slot = lora_slots[i]
            batch.rows.append(self._schedule(seq, run.num_scheduled_tokens[i], lookahead[i]))
        if offset != len(run.new_block_ids):
            raise MirrorMismatch("new_block_ids longer than num_new_blocks says")

    def _add(self, new: NewRequest, sampling: SamplingParams) -> ScheduledSeq:
        """new (its sampling params normalized) into the mirror; its share of the step."""
        if new.seq_id in self.seqs:
            raise MirrorMismatch(f"new seq {new.seq_id} is already in the mirror")
        if not 0 <= new.num_computed_tokens < len(new.token_ids):
            raise MirrorMismatch(
                f"seq {new.seq_id}: num_computed_tokens={new.num_computed_tokens} with "
                f"{len(new.token_ids)} token ids"
            )
        if not 0 < new.num_prompt_tokens <= len(new.token_ids):
            raise MirrorMismatch(
                f"seq {new.seq_id}: num_prompt_tokens={new.num_prompt_tokens} with "
                f"{len(new.token_ids)} token ids"
            )
        seq = SeqState(
            new.seq_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            sampling,
            self._checked_blocks(new.seq_id, new.block_table),
            new.num_computed_tokens,
            lora_slot=new.lora_slot,
            state_slot=new.state_slot,
            prompt_logprobs=new.prompt_top_logprobs if new.prompt_logprobs else -1,
        )
        if self.num_state_slots:
            self._check_state_slot(new)
        self.seqs[new.seq_id] = seq
        return self._schedule(seq, new.num_scheduled_tokens)

    def _check_state_slot(self, new: NewRequest) -> None:
        """new's state slot is in the pool and held by no other request, and new computes
        from its first token (its state is rebuilt: no prefix-cache hit can restore one)."""
        slot = new.state_slot
        if not 0 <= slot < self.num_state_slots:
            raise MirrorMismatch(
                f"seq {new.seq_id}: state_slot={slot} outside [0, {self.num_state_slots})"
            )
        holder = next((s.seq_id for s in self.seqs.values() if s.state_slot == slot), None)
        if holder is not None:
            raise MirrorMismatch(f"seq {new.seq_id}: state_slot={slot} is held by seq {holder}")
        restore = new.state_restore_from
        if restore and not self._is_snapshot_slot(restore):
            raise MirrorMismatch(f"seq {new.seq_id}: state_restore_from={restore} {self._where}")
        if bool(new.num_computed_tokens) != bool(restore):
            raise MirrorMismatch(
                f"seq {new.seq_id}: num_computed_tokens={new.num_computed_tokens} with "
                f"state_restore_from={restore}: a request with a recurrent state computes from "
                "its first token unless its state is restored from a snapshot"
            )

    @property
    def _where(self) -> str:
        first = self.num_state_slots
        return f"is not a state snapshot slot [{first}, {first + self.num_state_snapshot_slots})"

    def _is_snapshot_slot(self, slot: int) -> bool:
        first = self.num_state_slots
        return first <= slot < first + self.num_state_snapshot_slots

    def _check_state_snapshots(self, plan: StepPlanData) -> None:
        """plan's snapshots copy request slots into snapshot slots, one column each."""
        sources, targets = plan.state_snapshot_from, plan.state_snapshot_to
        if len(sources) != len(targets):
            raise MirrorMismatch(f"{len(sources)} state snapshot sources, {len(targets)} targets")
        for source, target in zip(sources, targets, strict=True):
            if not 0 <= source < self.num_state_slots:
                raise MirrorMismatch(
                    f"state_snapshot_from={source} outside [0, {self.num_state_slots})"
                )
            if not self._is_snapshot_slot(target):
                raise MirrorMismatch(f"state_snapshot_to={target} {self._where}")

    def _check_vocabulary(self, new: NewRequest) -> None:
        """Raise ValueError when new carries a token id outside the vocabulary."""
        if self.vocab_size:
            bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )

    def _held_blocks(self, seq: SeqState) -> list[int]:
        """seq's block table less the leading blocks wholly before its sliding window (which
        the scheduler may have released: scheduler/block_manager.py)."""
        if not self.sliding_window:
            return seq.block_table
        first_key = max(seq.num_computed_tokens - self.sliding_window + 1, 0)
        return seq.block_table[first_key // self.block_size :]

    def _checked_blocks(
        self, seq_id: int, block_ids: list[int], table: list[int] | None = None
    ) -> list[int]:
        """block_ids, to append to seq_id's block table (table): each inside the pool, and none
        twice in the table (a request's token slots never share a block)."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise MirrorMismatch(f"seq {seq_id}: block id outside [0, {self.num_blocks})")
        if len({*block_ids, *(table or ())}) != len(block_ids) + len(table or ()):
            raise MirrorMismatch(f"seq {seq_id}: a block id appears twice in its block table")
        return list(block_ids)

    def _schedule(self, seq: SeqState, num_scheduled: int, num_lookahead: int = 0) -> ScheduledSeq:
        end = seq.num_computed_tokens + num_scheduled
        if num_scheduled < 1 or end > len(seq.token_ids):
            raise MirrorMismatch(
                f"seq {seq.seq_id}: {num_scheduled} tokens scheduled after "
                f"{seq.num_computed_tokens} computed, but it has {len(seq.token_ids)} tokens"
            )
        samples = end == len(seq.token_ids)
        if num_lookahead < 0 or (num_lookahead and not samples):
            raise MirrorMismatch(
                f"seq {seq.seq_id}: {num_lookahead} lookahead slots on a row that "
                f"{'samples' if samples else 'does not sample'}"
            )
        if len(seq.block_table) * self.block_size < end + num_lookahead:
            raise MirrorMismatch(
                f"seq {seq.seq_id}: {len(seq.block_table)} blocks cannot hold "
                f"{end + num_lookahead} tokens"
            )
        return ScheduledSeq(seq, seq.num_computed_tokens, num_scheduled, samples, num_lookahead)

    def commit(self, batch: StepBatch, sampled_token_ids: list[int]) -> None:
        """One token rule, engine side: advance computed tokens; a request that reached its full
        length appends its sampled token (it is the next step's input)."""
        self.commit_pending(batch)
        self.resolve(batch, sampled_token_ids)

    def commit_pending(self, batch: StepBatch) -> None:
        """`commit` before the tokens are known: sampling rows append PLACEHOLDER and note where
        the token is (batch.step_id, row index) until `resolve`."""
        for i, row in enumerate(batch.rows):
            seq = row.seq
            seq.num_computed_tokens = row.end
            if row.samples:
                seq.token_ids.append(PLACEHOLDER)
                seq.pending_step_id, seq.pending_row = batch.step_id, i

    def resolve(self, batch: StepBatch, sampled_token_ids: list[int]) -> None:
        """Write the tokens of a step committed with commit_pending over its placeholders (a
        sampling row's token sits at index row.end). Requests dropped since are unaffected."""
        for row, token_id in zip(batch.rows, sampled_token_ids, strict=True):
            if not row.samples:
                continue
            seq = row.seq
            assert seq.token_ids[row.end] == PLACEHOLDER, f"seq {seq.seq_id}: no placeholder"
            seq.token_ids[row.end] = token_id
            if seq.pending_step_id == batch.step_id:
                seq.pending_step_id, seq.pending_row = 0, -1

    def commit_tokens(self, batch: StepBatch, tokens: list[list[int]]) -> None:
        """One token rule with proposals, for a step whose tokens are known (tokens[i]: row i's,
        its accepted proposals then the token sampled after them). A sampling row counts the
        accepted proposals as computed and appends every token:

            before: |<- computed ->|<- scheduled ->|<- proposed ---->|
            after:  |<- computed ------------------>|<- accepted ->|+ tokens[i][-1], not computed

        A row that had lookahead slots keeps only the blocks its tokens need (the scheduler
        frees the same ones): ceil(len(token_ids) / block_size). A draft model's computed
        tokens are cut back to the (target's) computed ones: past them, its K/V is that of
        rejected proposals (engine.proposer.DraftModelProposer)."""
        for row, row_tokens in zip(batch.rows, tokens, strict=True):
            seq = row.seq
            seq.num_computed_tokens = row.end
            if not row.samples:
                continue
            assert row_tokens[:-1] == row.draft_token_ids[: len(row_tokens) - 1], (
                f"seq {seq.seq_id}: accepted tokens differ from the proposed ones"
            )
            seq.num_computed_tokens += len(row_tokens) - 1
            # A draft model's K/V after the accepted proposals is that of rejected ones.
            seq.num_draft_computed_tokens = min(
                seq.num_draft_computed_tokens, seq.num_computed_tokens
            )
            seq.token_ids.extend(row_tokens)
            if row.num_lookahead_tokens:  # a new list: ids in a table are only ever appended
                # (engine/step_inputs.BlockTables copies only a table's new ids each step)
                seq.block_table = seq.block_table[: -(-len(seq.token_ids) // self.block_size)]


def _check_lora_slot(slot: int, failed: dict[int, str]) -> None:
    """Raise ValueError (the request is refused) when its slot's adapter failed to load."""
    if slot in failed:
        raise ValueError(failed[slot])
