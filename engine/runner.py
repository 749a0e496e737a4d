"""Runs one step: builds the flattened batch and its attention metadata, runs the forward pass,
samples the requests whose step completes their known tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.mirror import StepBatch
from engine.model import AttentionContext, LlamaForCausalLM
from engine.sampler import Sampler


@dataclass
class StepOutput:
    sampled_token_ids: list[int]  # -1 where the request is mid-prefill
    logprobs: list[float] | None  # NaN where not requested; None when nobody asked
    forward_ms: float
    sample_ms: float


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        sampler: Sampler,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler

    def _prepare(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens_q = [0]
        seq_lens: list[int] = []
        for row in batch.rows:
            seq, start, end = row.seq, row.start, row.end
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu_seqlens_q.append(cu_seqlens_q[-1] + row.num_scheduled_tokens)
            seq_lens.append(end)
        max_blocks = max(-(-n // bs) for n in seq_lens)
        tables = [r.seq.block_table[:max_blocks] for r in batch.rows]
        tables = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

        ctx = AttentionContext(
            slot_mapping=tensor(slots),
            block_tables=tensor(tables),
            seq_lens=seq_lens,
            cu_seqlens_q=cu_seqlens_q,
            kv_caches=self.kv_caches,
        )
        return tensor(input_ids), tensor(positions), ctx

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepOutput:
        t0 = time.perf_counter()
        input_ids, positions, ctx = self._prepare(batch)
        hidden = self.model(input_ids, positions, ctx)
        sampling_rows = [i for i, row in enumerate(batch.rows) if row.samples]
        tokens = [-1] * len(batch.rows)
        logprobs: list[float] | None = None
        if not sampling_rows:
            return StepOutput(tokens, None, (time.perf_counter() - t0) * 1e3, 0.0)
        last = torch.tensor(
            [ctx.cu_seqlens_q[i + 1] - 1 for i in sampling_rows], device=self.device
        )
        logits = self.model.compute_logits(hidden[last])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        rows = [batch.rows[i] for i in sampling_rows]
        sampled, chosen = self.sampler(
            logits, [r.seq.sampling for r in rows], [r.seq.num_output_tokens for r in rows]
        )
        for i, token in zip(sampling_rows, sampled.tolist(), strict=True):
            tokens[i] = token
        if chosen is not None:
            logprobs = [float("nan")] * len(batch.rows)
            for i, value in zip(sampling_rows, chosen.tolist(), strict=True):
                logprobs[i] = value
        t2 = time.perf_counter()
        return StepOutput(tokens, logprobs, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
