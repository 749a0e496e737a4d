"""Speculative decoding's proposers: cheap guesses of a request's next tokens, which the target
model then verifies in one forward (engine/runner.py, `ModelRunner.verify`).

A proposer fills `draft_token_ids` of the batch rows that have lookahead slots, at most
`num_lookahead_tokens` each, possibly none. Proposals are deterministic functions of the
request's tokens (the n-gram match, the draft model's argmax): verification relies on that (see
`verify`), and so does a seeded request's reproducibility.
"""

from __future__ import annotations

from array import array
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.mirror import ScheduledSeq, StepBatch
from engine.model import LlamaForCausalLM
from engine.ops import AttentionContext

_TOKEN_BYTES = array("i").itemsize


class Proposer(Protocol):
    name: str

    def propose(self, batch: StepBatch) -> None:
        """Set row.draft_token_ids (<= row.num_lookahead_tokens) on rows with lookahead slots."""
        ...


def ngram_match(token_ids: list[int], num_tokens: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup: for n from ngram_max down to ngram_min, find the latest earlier occurrence
    of token_ids' last n tokens and return up to num_tokens tokens that followed it (the first n
    that matches wins); [] when none does.

        token_ids: |... [match] continuation ...|... [last n] |
                        ^ starts before the last n tokens do
    """
    data = array("i", token_ids).tobytes()
    length = len(token_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = data[(length - n) * _TOKEN_BYTES :]
        # A match ends before the last token, so it is not the suffix itself and something
        # follows it.
        end = (length - 1) * _TOKEN_BYTES
        while (at := data.rfind(pattern, 0, end)) >= 0 and at % _TOKEN_BYTES:
            end = at + len(pattern) - 1  # a match across token boundaries: look further left
        if at >= 0:
            start = at // _TOKEN_BYTES + n
            return token_ids[start : start + num_tokens]
    return []


class NgramProposer:
    """Proposes what followed the latest earlier match of a request's last n tokens (prompt
    lookup decoding): free, and right when the output copies its input."""

    name = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, batch: StepBatch) -> None:
        for row in batch.rows:
            if row.num_lookahead_tokens:
                row.draft_token_ids = ngram_match(
                    row.seq.token_ids, row.num_lookahead_tokens, self.ngram_min, self.ngram_max
                )


class DraftProposer:
    """Self-speculation: the target's first num_layers layers, then its final norm and LM head,
    as a draft model proposing greedily, one token per forward, for all rows at once.

    It needs no KV pool of its own: its layers are the target's first ones, so at every token
    the target has verified, their K/V is what the draft would have computed. Draft forwards
    write K/V of those layers at the positions they propose for (the request's last known token
    and its proposals but the last, all inside its lookahead slots); the verification forward
    writes the same positions again before it attends to them, so the target never reads a
    value the draft wrote."""

    name = "draft"

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        num_layers: int,
    ):
        assert 0 < num_layers <= model.config.num_layers
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.num_layers = num_layers
        self.device = model.embed_tokens.weight.device

    @torch.inference_mode()
    def propose(self, batch: StepBatch) -> None:
        rows = [r for r in batch.rows if r.num_lookahead_tokens]
        for row in rows:
            row.draft_token_ids = []
        for j in range(max((r.num_lookahead_tokens for r in rows), default=0)):
            active = [r for r in rows if j < r.num_lookahead_tokens]
            inputs = [r.draft_token_ids[-1] if j else r.seq.token_ids[-1] for r in active]
            positions = [len(r.seq.token_ids) - 1 + j for r in active]
            tokens = self._next_tokens(active, inputs, positions)
            for row, token in zip(active, tokens, strict=True):
                row.draft_token_ids.append(token)

    def _next_tokens(
        self, rows: list[ScheduledSeq], input_ids: list[int], positions: list[int]
    ) -> list[int]:
        """The draft's argmax after input_ids[i] at positions[i], one token per row."""
        bs = self.block_size
        tables = [r.seq.block_table for r in rows]
        max_blocks = max(len(t) for t in tables)

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        ctx = AttentionContext(
            slot_mapping=tensor(slots),
            block_tables=tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
            seq_lens=[p + 1 for p in positions],
            cu_seqlens_q=list(range(len(rows) + 1)),
            kv_caches=self.kv_caches,
        )
        model = self.model
        ctx = model.ops.prepare(ctx)
        positions_t = tensor(positions)
        hidden, residual = model.embed_tokens(tensor(input_ids)), None
        for i in range(self.num_layers):
            hidden, residual = model.layers[i](positions_t, hidden, residual, ctx)
        hidden = model.norm(hidden, residual)[0]
        return model.compute_logits(hidden).argmax(dim=-1).tolist()


def make_proposer(
    config: EngineConfig,
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> Proposer | None:
    """config's proposer (None when it does not speculate)."""
    if config.speculative_method == "ngram":
        return NgramProposer(config.ngram_min, config.ngram_max)
    if config.speculative_method == "draft":
        num_layers = config.draft_num_layers or max(1, model.config.num_layers // 3)
        if num_layers > model.config.num_layers:
            raise ValueError(
                f"draft_num_layers={num_layers} exceeds the model's {model.config.num_layers} "
                f"layers"
            )
        return DraftProposer(model, kv_caches, config.block_size, num_layers)
    return None
