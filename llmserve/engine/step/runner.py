"""Runs one step: builds the flattened batch and its attention metadata, runs the forward pass,
samples the requests whose step completes their known tokens.

`launch` enqueues a step and returns without waiting for the device: the sampled tokens stay on
the device, where the next step gathers its inputs from them (a request's newest token may still
be a placeholder in the mirror), while non-blocking copies bring them to the host; `collect`
waits for those copies and builds the StepOutput. `execute` is both at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from llmserve.common.sampling import has_penalties
from llmserve.common.step_plan import StepOutput
from llmserve.engine.contract.mirror import PLACEHOLDER, ScheduledSeq, StepBatch
from llmserve.engine.features.grammar import Grammars, MaskJob
from llmserve.engine.features.lora import LoraSlots
from llmserve.engine.features.token_tree import (
    accept_path,
    chain_parents,
    compact_kv,
    main_chain_prefix,
    node_depths,
    path_tokens,
    row_attention,
    tree_depth,
    tree_kernel_args,
)
from llmserve.engine.kv.state import StateBatch, StatePool
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import AttentionContext
from llmserve.engine.parallel.groups import Parallel
from llmserve.engine.step.cuda_graphs import DecodeGraphs, is_decode_only
from llmserve.engine.step.inputs import BlockTables, flattened_inputs
from llmserve.engine.step.prompt_logprobs import PromptScores, score_prompts
from llmserve.engine.step.sampler import Sampler, SamplerOutput, to_device
from llmserve.engine.step.timeline import NullTimeline, Timeline
from llmserve.protos.common_pb2 import SamplingParams


class StepTimer:
    """Forward and sampling time of one step without synchronizing: host clocks on the CPU, CUDA
    events on a GPU (read once the step is done)."""

    def __init__(self, device: torch.device, t0: float):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = [self._event() if self.cuda else t0]

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        """End of the forward (the first call), then end of sampling."""
        self.marks.append(self._event() if self.cuda else time.perf_counter())

    def elapsed_ms(self) -> tuple[float, float]:
        """(forward_ms, sample_ms), once the step is done."""
        start, forward, sample = self.marks
        if self.cuda:
            return start.elapsed_time(forward), forward.elapsed_time(sample)
        return (forward - start) * 1e3, (sample - forward) * 1e3


@dataclass
class LaunchedStep:
    """A step whose work is enqueued, maybe not done. Per batch row: `sampled` the token on the
    device (-1 where the row does not sample), kept there for the next step's inputs; the `host`
    tensors (tokens, logprobs, top-k ids, top-k logprobs, each None when not asked) are
    non-blocking copies, complete once `ready` (a CUDA event; None on the CPU) is."""

    batch: StepBatch
    timer: StepTimer
    sampled: torch.Tensor
    host: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
    ready: Any = None
    output: StepOutput | None = None  # set by the engine once collected
    # A rank other than the driver: the broadcast bringing the driver's tokens into `sampled`
    # (host[0] is None: collect copies them once it is done).
    shared: Any = None
    # Rows that asked for prompt logprobs: their scored positions (engine/step/prompt_logprobs.py).
    prompt: PromptScores | None = None

    @property
    def is_ready(self) -> bool:
        if self.shared is not None and not self.shared.is_completed():
            return False
        return self.ready is None or bool(self.ready.query())

    def wait_shared(self) -> None:
        """Block until `sampled` holds the driver's tokens (other ranks)."""
        if self.shared is not None:
            self.shared.wait()

    def wait(self) -> None:
        """Block until the host copies are complete (the GIL is released meanwhile)."""
        self.wait_shared()
        if self.ready is not None:
            self.ready.synchronize()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
        *,
        graphs: DecodeGraphs | None = None,
        timeline: Timeline | None = None,
        parallel: Parallel | None = None,
        grammars: Grammars | None = None,
        lora: LoraSlots | None = None,
    ):
        """graphs: decode-only steps that fit replay from these (engine.cuda_graphs); timeline:
        records each step's GPU span (engine.timeline; a no-op by default); parallel: this
        rank's engine group (engine.parallel), when the model is split across ranks; grammars:
        the structured-output matchers (engine.grammar), on the rank that samples; lora: the
        adapter slots (engine.lora) rows name by seq.lora_slot."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.graphs = graphs
        self.timeline: Timeline = timeline or NullTimeline()
        self.parallel = parallel
        self.samples_here = parallel is None or parallel.topology.is_driver
        self.grammars = grammars if self.samples_here else None
        self.lora = lora
        # Hybrid linear-attention models: the state pool rows name by seq.state_slot.
        self.state_pool: StatePool | None = None
        self.block_tables = BlockTables()  # the rows' padded tables, kept between steps

    def _prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """The step's flattened inputs: each row's scheduled tokens, then its proposals."""
        segments = [
            (r.seq.block_table, r.seq.token_ids[r.start : r.end] + r.draft_token_ids, r.start)
            for r in batch.rows
        ]
        input_ids, positions, ctx = flattened_inputs(
            segments, self.block_size, self.kv_caches, self.device, tables=self.block_tables
        )
        if any(r.draft_parents for r in batch.rows):
            positions = self._tree_inputs(batch, ctx)
        if self.lora is not None:
            ctx.lora = self.lora.batch(
                [r.seq.lora_slot for r in batch.rows],
                [r.num_scheduled_tokens + len(r.draft_token_ids) for r in batch.rows],
            )
        if self.state_pool is not None:
            ctx.state = StateBatch(self.state_pool, [r.seq.state_slot for r in batch.rows])
        return input_ids, positions, ctx

    def _tree_inputs(self, batch: StepBatch, ctx: AttentionContext) -> torch.Tensor:
        """The rotary positions of a step with token trees (a node's: the row's last known
        position + its depth), and ctx.tree_masks, each tree row's attention mask
        (engine/features/token_tree.py)."""
        positions: list[int] = []
        masks: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for r in batch.rows:
            positions.extend(range(r.start, r.end))
            if r.draft_parents:
                mask, k_pos = row_attention(r.end, r.start, r.draft_parents)
                positions.extend(k_pos[r.end :].tolist())
                masks.append((mask.to(self.device), k_pos.to(self.device)))
            else:
                positions.extend(range(r.end, r.end + len(r.draft_token_ids)))
                masks.append(None)
        ctx.tree_masks = masks
        ctx.tree_bits, ctx.tree_start = tree_kernel_args(batch.rows, self.device)
        return to_device(positions, torch.long, self.device)

    def _keep_paths(self, batch: StepBatch, paths: list[list[int]]) -> None:
        """After a verification with token trees: each tree row's accepted nodes' K/V moved to
        consecutive positions after its known tokens, a draft model's computed tokens cut back
        to the main chain's accepted prefix (its pool holds the main chain), and the row's
        proposals replaced by the accepted path, a chain, as the mirror commits it."""
        moves: list[tuple[int, int]] = []
        bs = self.block_size
        for row, path in zip(batch.rows, paths, strict=True):
            if not row.draft_parents:
                continue
            table = row.seq.block_table
            for i, node in enumerate(path):
                if node != i:
                    src, dst = row.end + node, row.end + i
                    moves.append(
                        (table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs)
                    )
            seq = row.seq
            prefix = main_chain_prefix(path, row.draft_parents)
            seq.num_draft_computed_tokens = min(seq.num_draft_computed_tokens, row.end + prefix)
            row.draft_token_ids = [row.draft_token_ids[node] for node in path]
            row.draft_parents = []
        compact_kv(self.kv_caches, moves)

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run a step whose inputs are all known and wait for its output."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: StepBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Enqueue batch's forward and sampling; return without waiting for the device. prev is
        the step launched before, whose sampled tokens fill this step's placeholder inputs."""
        t0 = time.perf_counter()
        input_ids, positions, ctx = self._prepare(batch)
        self._gather_placeholders(batch, input_ids, prev)
        timer = StepTimer(self.device, t0)
        masks = self._start_masks(batch, prev)  # filled while the forward runs
        self.timeline.begin()
        hidden = self._run_stage(input_ids, positions, ctx)
        prompt = None
        if self.model.shard.last:
            prompt = score_prompts(self.model, hidden, batch, ctx.cu_seqlens_q)
        sampling_rows = [i for i, row in enumerate(batch.rows) if row.samples]
        out = None
        if sampling_rows and self.model.shard.last:
            last = to_device(
                [ctx.cu_seqlens_q[i + 1] - 1 for i in sampling_rows], torch.long, self.device
            )
            logits = self.model.compute_logits(hidden[last])
            timer.mark()
            if self.samples_here:
                apply_masks(logits, masks)
                out = self.sampler.sample(logits, *_sampler_inputs(batch.rows))
        else:
            timer.mark()
        timer.mark()  # before _spread records `ready`: collect reads the timer once that is done
        decode_only = is_decode_only(ctx.seq_lens, ctx.cu_seqlens_q)
        self.timeline.end(batch.step_id, len(ctx.seq_lens), ctx.cu_seqlens_q[-1], decode_only)
        step = self._spread(batch, timer, sampling_rows, out)
        step.prompt = prompt
        return step

    @torch.inference_mode()
    def verify(self, batch: StepBatch) -> tuple[StepOutput, list[list[int]]]:
        """Run a step whose sampling rows may carry proposed tokens (row.draft_token_ids) and
        wait for it: (its output, each row's tokens). Single rank only (the engine refuses
        speculation with parallel ranks).

        A row with d proposals is sampled at its last 1 + d positions, position j as if the
        proposals before it had been generated (output index, penalty counts); proposal j is
        accepted while it equals the token sampled at position j, and the row returns the
        accepted ones and the token sampled after them. For a deterministic proposal q is
        one-hot, and this is rejection sampling (Leviathan et al.): the proposal x is kept with
        probability p(x), and on rejection the token is drawn from p without x, renormalized,
        i.e. from max(p - q, 0). Each token is a draw from the target's distribution given the
        tokens before it, so greedy output is exactly that of decoding without proposals, and a
        seeded row's draws use the same (seed, output index) keys, so its output is too."""
        assert self.parallel is None, "speculative decoding runs on a single rank"
        t0 = time.perf_counter()
        input_ids, positions, ctx = self._prepare(batch)
        timer = StepTimer(self.device, t0)
        masks = self._start_masks(batch, None)
        hidden = self._forward(input_ids, positions, ctx)
        prompt = score_prompts(self.model, hidden, batch, ctx.cu_seqlens_q)
        index: list[int] = []
        for i, row in enumerate(batch.rows):
            if row.samples:
                end = ctx.cu_seqlens_q[i + 1]
                index.extend(range(end - 1 - len(row.draft_token_ids), end))
        out = None
        if index:
            logits = self.model.compute_logits(hidden[to_device(index, torch.long, self.device)])
            timer.mark()
            apply_masks(logits, masks)
            out = self.sampler.sample(logits, *_sampler_inputs(batch.rows))
        else:
            timer.mark()
        timer.mark()
        output, tokens, paths = _verified_output(batch, out, timer)
        if prompt is not None:
            prompt.add_to(output)
        self._keep_paths(batch, paths)
        return output, tokens

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's results to reach the host; its StepOutput."""
        step.wait()
        tokens, logprobs, top_ids, top_lps = step.host
        if tokens is None:  # a rank that did not sample: the driver's tokens
            tokens = step.sampled.cpu()
        params = [r.seq.sampling if r.samples else None for r in step.batch.rows]
        top = None
        if top_ids is not None and top_lps is not None:
            top = (top_ids.tolist(), top_lps.tolist())
        logprobs_list = logprobs.tolist() if logprobs is not None else None
        output = _step_output(params, tokens.tolist(), logprobs_list, top, step.timer)
        if step.prompt is not None:
            step.prompt.add_to(output)
        return output

    def _start_masks(self, batch: StepBatch, prev: LaunchedStep | None) -> MaskJob | None:
        """The structured-output masks of batch's constrained sampling positions, started on
        the mask thread (None when no sampling row is constrained, or this rank does not
        sample). A request whose newest token is prev's reads it from prev's host copy there."""
        if self.grammars is None or not self.model.shard.last:
            return None

        def host_tokens() -> list[int]:
            assert prev is not None
            prev.wait()
            tokens = prev.host[0]
            return (tokens if tokens is not None else prev.sampled.cpu()).tolist()

        return self.grammars.start_masks(batch.rows, host_tokens if prev is not None else None)

    def _gather_placeholders(
        self, batch: StepBatch, input_ids: torch.Tensor, prev: LaunchedStep | None
    ) -> None:
        """A request's newest token may be a placeholder (the previous step sampled it and its
        result is not on the host yet): copy it from prev.sampled into input_ids on the device.

            input_ids: |<- row 0's tokens ->|<- row 1's: ... PLACEHOLDER ->|<- row 2's ...
                                                              ^ prev.sampled[seq.pending_row]
        """
        dst: list[int] = []
        src: list[int] = []
        offset = 0
        for row in batch.rows:
            seq = row.seq
            position = len(seq.token_ids) - 1
            if seq.pending_row >= 0 and row.start <= position < row.end:
                if prev is None or seq.pending_step_id != prev.batch.step_id:
                    raise RuntimeError(
                        f"seq {seq.seq_id}: its token from step {seq.pending_step_id} is neither "
                        f"known nor the previous step's"
                    )
                dst.append(offset + position - row.start)
                src.append(seq.pending_row)
            offset += row.num_scheduled_tokens
        if dst:
            assert prev is not None
            prev.wait_shared()
            index = to_device(dst + src, torch.long, self.device).view(2, -1)
            input_ids[index[0]] = prev.sampled[index[1]]

    def _spread(
        self,
        batch: StepBatch,
        timer: StepTimer,
        sampling_rows: list[int],
        out: SamplerOutput | None,
    ) -> LaunchedStep:
        """The sampled rows' results over all batch rows (-1 / NaN elsewhere), on the device, and
        their non-blocking copies to the host."""
        n = len(batch.rows)
        sampled = torch.full((n,), PLACEHOLDER, dtype=torch.long, device=self.device)
        if not self.samples_here:
            assert self.parallel is not None
            shared = self.parallel.share_tokens(sampled)
            return LaunchedStep(batch, timer, sampled, (None, None, None, None), shared=shared)
        logprobs = top_ids = top_lps = None
        if out is not None:
            rows = to_device(sampling_rows, torch.long, self.device)
            sampled[rows] = out.token_ids
            if out.logprobs is not None:
                logprobs = _full_rows(n, rows, out.logprobs, float("nan"))
            if out.top_token_ids is not None and out.top_logprobs is not None:
                top_ids = _full_rows(n, rows, out.top_token_ids, -1)
                top_lps = _full_rows(n, rows, out.top_logprobs, float("nan"))
        if self.parallel is not None:
            self.parallel.share_tokens(sampled)
        host = (
            sampled.to("cpu", non_blocking=True),
            _to_host(logprobs),
            _to_host(top_ids),
            _to_host(top_lps),
        )
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(batch, timer, sampled, host, ready)

    def _run_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """This rank's part of the forward: after the previous stage's, before the next's
        (pipeline parallelism), whose input it sends on; the final hidden states on the last
        stage."""
        shard = self.model.shard
        if self.parallel is None or (shard.first and shard.last):
            return self._forward(input_ids, positions, ctx)
        carried = None
        if not shard.first:
            first_layer = self.model.layers[shard.layers.start]
            carried = self.parallel.receive_activations(
                len(input_ids),
                self.model.config.hidden_size,
                next(first_layer.parameters()).dtype,  # any layer's (Nemotron-H's: `norm`)
            )
        hidden = self.model(input_ids, positions, ctx, carried)
        if not shard.last:
            self.parallel.send_activations(hidden)
        return hidden

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """The model's final hidden states: replayed from a CUDA graph when the step is decode-only
        and small enough, else an eager forward."""
        if self.graphs is not None and ctx.lora is None and self.graphs.can_run(ctx):
            return self.graphs.run(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx)


def _sampler_inputs(
    rows: list[ScheduledSeq],
) -> tuple[list[SamplingParams], list[int], list[list[int]]]:
    """The sampler's inputs, per sampled position (a sampling row's last 1 + d, d its proposals:
    0 but in verify): its request's params, its output index, and, when any row has penalties,
    its generated tokens where it has them (the proposals before the position counted as
    generated; [] elsewhere); no lists when none has."""
    params: list[SamplingParams] = []
    output_indices: list[int] = []
    outputs: list[list[int]] = []
    any_penalized = False
    for row in rows:
        if not row.samples:
            continue
        seq = row.seq
        penalized = has_penalties(seq.sampling)
        any_penalized |= penalized
        generated = seq.token_ids[seq.num_prompt_tokens :] if penalized else []
        drafts, parents = row.draft_token_ids, row.draft_parents
        depths = node_depths(parents) if parents else range(1, len(drafts) + 1)
        for j in range(len(drafts) + 1):
            params.append(seq.sampling)
            output_indices.append(seq.num_output_tokens + (depths[j - 1] if j else 0))
            if not penalized:
                outputs.append([])
                continue
            before = path_tokens(drafts, parents, j - 1) if parents else drafts[:j]
            outputs.append([*generated, *before])
    return params, output_indices, outputs if any_penalized else []


def _step_output(
    params: list[SamplingParams | None],
    tokens: list[int],
    logprobs: list[float] | None,
    top: tuple[list[list[int]], list[list[float]]] | None,
    timer: StepTimer,
) -> StepOutput:
    """A StepOutput of one entry per returned token: its request's params (None where its row
    sampled nothing: NaN logprob, no top logprobs), the token, its logprob and its top-k ids and
    logprobs (most likely first), each kept only where the request asked."""
    output = StepOutput(tokens, None, *timer.elapsed_ms())
    if logprobs is not None:  # NaN where the request did not ask
        output.logprobs = [
            lp if p is not None and p.logprobs else math.nan
            for lp, p in zip(logprobs, params, strict=True)
        ]
    if top is not None:
        for p, ids, lps in zip(params, *top, strict=True):
            n = min(p.top_logprobs, len(ids)) if p is not None else 0
            output.num_top_logprobs.append(n)
            output.top_token_ids += ids[:n]
            output.top_logprobs += lps[:n]
    return output


def _accepted(sampled: list[int], row: ScheduledSeq) -> list[int]:
    """The accepted nodes of row's proposals (a chain's: while each equals the token sampled
    before it; a tree's: engine/features/token_tree.py's walk), given its sampled tokens (one
    per position: its last known token's, then each proposal's)."""
    parents = row.draft_parents or chain_parents(len(row.draft_token_ids))
    return accept_path(sampled, row.draft_token_ids, parents)


def _verified_output(
    batch: StepBatch, out: SamplerOutput | None, timer: StepTimer
) -> tuple[StepOutput, list[list[int]], list[list[int]]]:
    """verify's StepOutput (tokens, logprobs and top logprobs per returned token), each row's
    tokens ([-1] where it samples nothing) and its accepted proposals' indices."""
    sampled = out.token_ids.tolist() if out is not None else []
    lps = out.logprobs.tolist() if out is not None and out.logprobs is not None else None
    top_ids = top_lps = None
    if out is not None and out.top_token_ids is not None and out.top_logprobs is not None:
        top_ids, top_lps = out.top_token_ids.tolist(), out.top_logprobs.tolist()
    tokens: list[list[int]] = []
    paths: list[list[int]] = []
    positions: list[int] = []  # per returned token, its sampled position (-1: none)
    position = 0
    for row in batch.rows:
        if not row.samples:
            tokens.append([-1])
            paths.append([])
            positions.append(-1)
            continue
        num_positions = len(row.draft_token_ids) + 1
        paths.append(_accepted(sampled[position : position + num_positions], row))
        offsets = [position, *(position + 1 + node for node in paths[-1])]
        tokens.append([sampled[at] for at in offsets])
        positions.extend(offsets)
        position += num_positions
    params = [
        row.seq.sampling if row.samples else None
        for row, row_tokens in zip(batch.rows, tokens, strict=True)
        for _ in row_tokens
    ]
    top = None
    if top_ids is not None and top_lps is not None:
        row_ids = [top_ids[p] if p >= 0 else [] for p in positions]
        top = (row_ids, [top_lps[p] if p >= 0 else [] for p in positions])
    logprobs = [lps[p] if p >= 0 else math.nan for p in positions] if lps is not None else None
    flat = [t for row_tokens in tokens for t in row_tokens]
    output = _step_output(params, flat, logprobs, top, timer)
    # A tree's count is its depth (the most it could have accepted), so that the scheduler's
    # acceptance rates mean for a tree what they mean for a chain
    output.num_draft_tokens = [
        tree_depth(row.draft_parents) if row.draft_parents else len(row.draft_token_ids)
        for row in batch.rows
    ]
    output.num_sampled_tokens = [len(row_tokens) for row_tokens in tokens]
    return output, tokens, paths


def apply_masks(logits: torch.Tensor, masks: MaskJob | None) -> None:
    """Set to -inf, in place, the logits of tokens a constrained position's grammar does not
    allow (masks: the step's job, waited for here; None: nothing to do). logits has one row
    per sampled position."""
    if masks is None:
        return
    positions, bitmask = masks.result()
    device = logits.device
    words = torch.from_numpy(bitmask).to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).view(len(positions), -1)[:, : logits.shape[1]]
    rows = to_device(positions, torch.long, device)
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to("cpu", non_blocking=True) if t is not None else None


def _full_rows(n: int, rows: torch.Tensor, values: torch.Tensor, fill: float) -> torch.Tensor:
    """values (one row per sampled row) placed at `rows` of an n-row tensor filled with fill."""
    full = torch.full((n, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    full[rows] = values
    return full
