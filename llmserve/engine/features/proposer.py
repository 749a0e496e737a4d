"""Speculative decoding's proposers: cheap guesses of a request's next tokens, which the target
model then verifies in one forward (engine/step/runner.py, `ModelRunner.verify`).

A proposer fills `draft_token_ids` of the batch rows that have lookahead slots, at most
`num_lookahead_tokens` each, possibly none; a tree's proposer (--speculative-tree-width > 1) also
`draft_parents` (engine/features/token_tree.py), its chains at most `depth` tokens deep.
Proposals are deterministic functions of the request's tokens (the n-gram match, the draft
model's top tokens): verification relies on that (see `verify`), and so does a seeded request's
reproducibility.
"""

from __future__ import annotations

from array import array
from typing import Protocol

import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.mirror import ScheduledSeq, StepBatch
from llmserve.engine.features.token_tree import chain_parents, ngram_tree, with_siblings
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.step.inputs import Segment, flattened_inputs, padded_block_tables
from llmserve.engine.step.sampler import to_device

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


def set_tree(row: ScheduledSeq, tokens: list[int], parents: list[int]) -> None:
    """row's proposals: tokens with parents, as a chain where they are one. A request with a
    grammar keeps the main chain only (its masks follow one sequence of proposals)."""
    if row.seq.grammar is not None or parents == chain_parents(len(parents)):
        n = 0
        while n < len(parents) and parents[n] == n - 1:
            n += 1
        row.draft_token_ids, row.draft_parents = tokens[:n], []
    else:
        row.draft_token_ids, row.draft_parents = tokens, parents


class NgramProposer:
    """Proposes what followed the latest earlier match of a request's last n tokens (prompt
    lookup decoding): free, and right when the output copies its input. With width > 1, a tree
    of the continuations after up to width distinct matches (token_tree.ngram_tree), each at
    most depth deep."""

    name = "ngram"

    def __init__(self, ngram_min: int, ngram_max: int, depth: int = 0, width: int = 1):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.depth = depth
        self.width = width

    def propose(self, batch: StepBatch) -> None:
        for row in batch.rows:
            if not row.num_lookahead_tokens:
                continue
            if self.width == 1:
                row.draft_token_ids = ngram_match(
                    row.seq.token_ids, row.num_lookahead_tokens, self.ngram_min, self.ngram_max
                )
                continue
            tree = ngram_tree(
                row.seq.token_ids,
                row.num_lookahead_tokens,
                min(self.depth, row.num_lookahead_tokens),
                self.width,
                self.ngram_min,
                self.ngram_max,
            )
            set_tree(row, *tree)


class DraftForward:
    """Forwards of a draft: `num_layers` layers of `model` (all of them, or the first ones for
    self-speculation), then its final norm and LM head, over `kv_caches`, outside the step's
    own forward. Each call runs one flattened forward over segments of the batch's rows."""

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
        self.device = model.rotary_emb.cos_sin_cache.device  # embeddings may be GGUF blocks

    def block_tables(self, rows: list[ScheduledSeq]) -> torch.Tensor:
        """rows' whole block tables, padded, on the device: built once for the forwards of
        single tokens that follow one another inside the rows' lookahead slots."""
        tables = [row.seq.block_table for row in rows]
        return padded_block_tables(tables, max(len(t) for t in tables), self.device)

    def argmax(
        self, segments: list[Segment], block_tables: torch.Tensor | None = None
    ) -> list[int]:
        """Per segment (engine.step_inputs): its tokens' forward, writing their K/V; the
        draft's argmax after the segment's last token. block_tables: the segments' padded
        tables on the device, when the caller has them."""
        return [best[0] for best in self.top(segments, block_tables, 1)]

    @torch.inference_mode()
    def top(
        self, segments: list[Segment], block_tables: torch.Tensor | None, k: int
    ) -> list[list[int]]:
        """argmax's forward; the draft's k most likely tokens per segment, best first."""
        model = self.model
        input_ids, positions, ctx = flattened_inputs(
            segments, self.block_size, self.kv_caches, self.device, block_tables
        )
        hidden, residual = model.run_layers(
            input_ids, positions, ctx, layers=range(self.num_layers)
        )
        last = to_device([end - 1 for end in ctx.cu_seqlens_q[1:]], torch.long, self.device)
        hidden = model.norm(hidden[last], residual[last])[0]
        logits = model.compute_logits(hidden)
        if k == 1:
            return [[t] for t in logits.argmax(dim=-1).tolist()]
        return logits.topk(k, dim=-1).indices.tolist()


def _propose_rest(
    forward: DraftForward,
    rows: list[ScheduledSeq],
    lengths: list[int],
    width: int,
    alts: list[list[list[int]]],
) -> None:
    """Given each row's first proposal, its others: proposal j from proposal j - 1 at position
    len(token_ids) - 1 + j, one single-token forward for all rows per j, over block tables
    built once; row i's chain stops at lengths[i]. alts[i] gets, per proposal, the draft's next
    width - 1 tokens there."""
    num_forwards = max(lengths, default=0) - 1
    if num_forwards <= 0:
        return
    tables = forward.block_tables(rows)
    live = list(range(len(rows)))
    for j in range(1, num_forwards + 1):
        active = [a for a, i in enumerate(live) if j < lengths[i]]
        if len(active) < len(live):
            tables = tables[to_device(active, torch.long, forward.device)]
            live = [live[a] for a in active]
        segments = [
            (
                rows[i].seq.block_table,
                [rows[i].draft_token_ids[-1]],
                len(rows[i].seq.token_ids) - 1 + j,
            )
            for i in live
        ]
        for i, best in zip(live, forward.top(segments, tables, width), strict=True):
            rows[i].draft_token_ids.append(best[0])
            alts[i].append(best[1:])


def _finish_trees(rows: list[ScheduledSeq], alts: list[list[list[int]]], width: int) -> None:
    """With width > 1, each row's chain becomes a tree: the draft's other top tokens as leaves
    beside each proposal, within the row's lookahead slots (token_tree.with_siblings)."""
    if width == 1:
        return
    for row, row_alts in zip(rows, alts, strict=True):
        set_tree(row, *with_siblings(row.draft_token_ids, row_alts, row.num_lookahead_tokens))


class DraftProposer:
    """Self-speculation: the target's first num_layers layers, then its final norm and LM head,
    as a draft model proposing greedily, one token per forward, for all rows at once (with
    width > 1 a tree: its top-width tokens at each depth, the best continuing).

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
        depth: int = 0,
        width: int = 1,
    ):
        self.forward = DraftForward(model, kv_caches, block_size, num_layers)
        self.depth = depth or 1 << 30
        self.width = width

    def propose(self, batch: StepBatch) -> None:
        rows = [r for r in batch.rows if r.num_lookahead_tokens]
        if not rows:
            return
        first = [(r.seq.block_table, [r.seq.token_ids[-1]], len(r.seq.token_ids) - 1) for r in rows]
        alts: list[list[list[int]]] = []
        for row, best in zip(rows, self.forward.top(first, None, self.width), strict=True):
            row.draft_token_ids = [best[0]]
            alts.append([best[1:]])
        lengths = [min(r.num_lookahead_tokens, self.depth) for r in rows]
        _propose_rest(self.forward, rows, lengths, self.width, alts)
        _finish_trees(rows, alts, self.width)


class DraftModelProposer:
    """A separate draft model (--speculative-model: smaller, the target's vocabulary) with a
    paged KV pool of its own, proposing greedily (with width > 1 a tree, as DraftProposer's;
    its pool holds the main chain's K/V). Its pool has the target's block geometry in
    blocks and tokens (its own layers, KV heads and head size): a request's block table, the
    scheduler's, addresses both pools, so the scheduler knows nothing of the draft.

    Its KV is caught up lazily, only when a request speculates, so steps without lookahead
    slots (and overlap) are untouched. Per request, seq.num_draft_computed_tokens (n) counts the
    leading tokens whose K/V the draft's pool holds; a proposing row of L known tokens
    (n <= L - 1: its newest token is never computed) with k lookahead slots:

        token_ids:  |<- draft computed (n) ->|<- caught up ->|
                    0                        n               L
        catch-up:   one forward of tokens [n, L) at positions n..L-1 (writes their K/V) whose
                    last logits give proposal d0, for position L
        then:       d_{j-1} at position L - 1 + j gives d_j, j = 1 .. k-1 (writes K/V of
                    d0 .. d_{k-2} at L .. L+k-2, inside the lookahead slots)
        so:         n = L + k - 1, positions L.. holding proposals, not known tokens

    After verification (engine.mirror.Mirror.commit_tokens) n = min(n, num_computed_tokens):
    the target has computed L plus the accepted proposals, and every position before that holds
    an accepted token, so the draft's K/V there is right, and past it is a rejected proposal's
    (or none). A tree's verification first cuts n to L plus the accepted path's prefix on the
    main chain (engine/step/runner.py _keep_paths). A request new to the engine starts at n = 0
    (the draft's K/V is not in the
    prefix cache's bookkeeping): its whole prompt is caught up, writing into shared prefix
    blocks of the draft's pool the values they already hold, if any. A request that decodes
    without lookahead (disabled, backed off) keeps its n and catches up when it speculates
    again. The catch-up forwards hold at most max_num_batched_tokens tokens each (a long prompt
    takes several, in order), as the target's steps do."""

    name = "draft"

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_num_batched_tokens: int,
        depth: int = 0,
        width: int = 1,
    ):
        self.forward = DraftForward(model, kv_caches, block_size, model.config.num_layers)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.depth = depth or 1 << 30
        self.width = width

    def propose(self, batch: StepBatch) -> None:
        rows = [r for r in batch.rows if r.num_lookahead_tokens]
        if not rows:
            return
        alts = self._catch_up(rows)
        lengths = [min(r.num_lookahead_tokens, self.depth) for r in rows]
        _propose_rest(self.forward, rows, lengths, self.width, alts)
        for row in rows:
            row.seq.num_draft_computed_tokens = (
                len(row.seq.token_ids) + len(row.draft_token_ids) - 1
            )
        _finish_trees(rows, alts, self.width)

    def _catch_up(self, rows: list[ScheduledSeq]) -> list[list[list[int]]]:
        """Each row's tokens from its draft computed tokens to its end, in forwards of at most
        max_num_batched_tokens tokens; a row's first proposal from its last one. Per row, the
        draft's next width - 1 tokens beside that proposal."""
        pending: list[tuple[ScheduledSeq, int]] = []  # (row, next position)
        for row in rows:
            seq = row.seq
            assert 0 <= seq.num_draft_computed_tokens < len(seq.token_ids), seq.seq_id
            pending.append((row, seq.num_draft_computed_tokens))
        alts: dict[int, list[int]] = {}
        budget = self.max_num_batched_tokens
        while pending:
            chunk: list[tuple[ScheduledSeq, int, int]] = []  # (row, start, end)
            room = budget
            while pending and room:
                row, start = pending.pop(0)
                end = min(len(row.seq.token_ids), start + room)
                chunk.append((row, start, end))
                room -= end - start
                if end < len(row.seq.token_ids):
                    pending.insert(0, (row, end))
            segments = [(r.seq.block_table, r.seq.token_ids[s:e], s) for r, s, e in chunk]
            tops = self.forward.top(segments, None, self.width)
            for (row, _, end), best in zip(chunk, tops, strict=True):
                if end == len(row.seq.token_ids):
                    row.draft_token_ids = [best[0]]
                    alts[id(row)] = best[1:]
        return [[alts[id(row)]] for row in rows]


def make_proposer(
    config: EngineConfig,
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    draft_model: LlamaForCausalLM | None = None,
    draft_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Proposer | None:
    """config's proposer (None when it does not speculate); draft_model and its pool's layer
    views: the --speculative-model, when there is one."""
    tree_width = config.speculative_tree_width
    if config.speculative_method == "ngram":
        return NgramProposer(
            config.ngram_min, config.ngram_max, config.num_speculative_tokens, tree_width
        )
    if config.speculative_method == "draft" and draft_model is not None:
        assert draft_kv_caches is not None
        return DraftModelProposer(
            draft_model, draft_kv_caches, config.block_size, config.max_num_batched_tokens,
            config.num_speculative_tokens, tree_width,
        )  # fmt: skip
    if config.speculative_method == "draft":
        num_layers = config.draft_num_layers or max(1, model.config.num_layers // 3)
        if num_layers > model.config.num_layers:
            raise ValueError(
                f"draft_num_layers={num_layers} exceeds the model's {model.config.num_layers} "
                f"layers"
            )
        return DraftProposer(
            model, kv_caches, config.block_size, num_layers, config.num_speculative_tokens,
            tree_width,
        )  # fmt: skip
    return None
