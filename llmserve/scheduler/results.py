"""Step results: a step's sampled tokens become each request's tokens (the one token rule), and
requests that stop are finished."""

from __future__ import annotations

import math

from llmserve.scheduler.disagg.handoffs import Disaggregation
from llmserve.scheduler.plan import (
    NewRequestRow,
    RunningRow,
    StepOutcome,
    StepPlan,
    TopLogprobColumns,
)
from llmserve.scheduler.request import Request, RequestStatus


class StepResults(Disaggregation):
    def update(
        self,
        plan: StepPlan,
        sampled_token_ids: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: TopLogprobColumns | None = None,
        num_sampled_tokens: list[int] | None = None,
        num_draft_tokens: list[int] | None = None,
    ) -> list[StepOutcome]:
        """Apply a step's result; results come in plan order, one token per row, or
        num_sampled_tokens[i] for row i when given (speculative decoding: the proposals it
        accepted, then the token sampled after them); logprobs and top_logprobs per token (NaN
        where a request did not ask); num_draft_tokens: per row, the tokens the engine proposed.

        One token rule: a row that completed its request's tokens when planned (`samples`)
        turns the request's oldest pending token into its first token and appends the others;
        the accepted proposals count as computed, the rejected ones' slots are given back (see
        `_accept`). A mid-prefill row's token is discarded. Rows of requests that ended
        (finished, aborted) or were preempted since the plan are skipped: with overlap, a
        request that finished at step N may be in step N+1 too, and that token is dropped. A
        request that stops at one of its tokens drops the ones after it. Finished requests free
        their blocks."""
        rows = plan.rows
        counts = num_sampled_tokens or [1] * len(rows)
        assert len(counts) == len(rows) and sum(counts) == len(sampled_token_ids), (
            f"step {plan.step_id}: {len(sampled_token_ids)} tokens for {len(rows)} requests"
            + (f" (num_sampled_tokens={counts})" if num_sampled_tokens else "")
        )
        self.last_result_step_id = max(self.last_result_step_id, plan.step_id)
        top_rows = top_logprobs.rows() if top_logprobs is not None else None
        outcomes: list[StepOutcome] = []
        start = 0
        for i, row in enumerate(rows):
            tokens = range(start, start + counts[i])
            start += counts[i]
            if not row.samples or not self._awaits(row):
                continue
            request = row.request
            assert all(sampled_token_ids[t] >= 0 for t in tokens), (
                f"step {plan.step_id}: no token for {request.request_id}"
            )
            if num_draft_tokens:
                self._accept(row, num_draft_tokens[i], len(tokens) - 1)
            request.num_pending_tokens -= 1  # its oldest pending token is the first one
            for t in tokens:
                outcome = self._take_token(request, sampled_token_ids[t])
                if outcome is None:
                    continue
                if logprobs and not math.isnan(logprobs[t]):
                    outcome.logprob = logprobs[t]
                if top_rows is not None:
                    outcome.top_token_ids, outcome.top_logprobs = top_rows[t]
                outcomes.append(outcome)
                if outcome.finished is not None:
                    break
            if request.status == RequestStatus.RUNNING and isinstance(row, RunningRow):
                self._give_back_lookahead(row)
        self._count_generated(outcomes)
        self._after_update()
        return outcomes

    def _take_token(self, request: Request, token_id: int) -> StepOutcome | None:
        """Append token_id, request's oldest pending token now known, to its tokens: its
        outcome, or None when nothing is to be streamed (`_on_token`)."""
        request.token_ids.append(token_id)
        outcome = self._on_token(request, token_id)
        if outcome is not None and outcome.finished is None and self._hands_off(request):
            self._hand_off(request)  # its first token is streamed from here, once
        return outcome

    def _count_generated(self, outcomes: list[StepOutcome]) -> None:
        """Count outcomes' tokens as generated, in total and for their tenants."""
        self.counters.num_generated_tokens += len(outcomes)
        for outcome in outcomes:
            self.tenants.count_generated(outcome.request.tenant)

    def _accept(self, row: NewRequestRow | RunningRow, num_draft: int, num_accepted: int) -> None:
        """row's request accepted num_accepted of num_draft proposed tokens: they were computed
        in the step (their KV is in the lookahead slots), the rejected ones were not.

            slots:  |<- computed ->|<- lookahead slots ------------>|
            after:  |<- computed ---------------->|<- given back ->|
                                   |<- accepted ->|
        """
        assert num_accepted <= num_draft <= getattr(row, "num_lookahead_tokens", 0), (
            f"{row.request.request_id}: {num_accepted} accepted of {num_draft} proposed"
        )
        row.request.num_computed_tokens += num_accepted
        self.counters.spec.add(num_draft, num_accepted)
        self.speculation.on_result(row.request, num_draft, num_accepted)

    def _give_back_lookahead(self, row: RunningRow) -> None:
        """After a row with lookahead slots: free the blocks its request's tokens do not need
        (the engine's mirror drops the same ones)."""
        if row.num_lookahead_tokens:
            request = row.request
            self.block_manager.trim(request, len(request.token_ids))
            request.mirror.num_sent_blocks = len(request.block_table)

    def _on_token(self, request: Request, token_id: int) -> StepOutcome | None:
        """request's oldest pending token turned out to be token_id, now its last: its outcome
        (hook: None when nothing is to be streamed)."""
        finished = self._check_stop(request, token_id)
        if finished is not None:
            self._on_stopped(request, finished)
        return StepOutcome(request, token_id, None, finished)

    def _after_update(self) -> None:
        if not self.requests:
            self.block_manager.check_integrity([])

    @staticmethod
    def _awaits(row: NewRequestRow | RunningRow) -> bool:
        """Whether row's request still waits for this row's token: it runs, in the same life
        (not preempted since), with a pending token."""
        request = row.request
        if request.status != RequestStatus.RUNNING:
            return False
        if request.num_preemptions != row.num_preemptions:
            return False
        assert request.num_pending_tokens > 0, f"{request.request_id}: a token nobody awaits"
        return True

    def _on_stopped(self, request: Request, status: RequestStatus) -> None:
        """request finished with status (hook): free it. Its outcome reports it finished."""
        self.running.remove(request)
        self._finish(request, status)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        if request.grammar_dead_end:  # ignore_eos or not: the constraint allows nothing more
            return RequestStatus.FINISHED_GRAMMAR_DEAD_END
        if token_id in self.eos_token_ids and not request.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in request.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
