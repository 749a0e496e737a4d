"""Decode steps replayed from CUDA graphs.

A decode-only step (every request computes one new token) of n requests replays the graph
captured for the smallest captured batch size >= n. Everything a graph reads is a static buffer
filled in place before the replay; rows n.. of a padded batch are padding:

    rows:         0 ............ n-1 | n ........... size-1
    slot_mapping: the requests' slots | -1  (store_kv skips the row)
    seq_lens:     context lengths     | 0   (attention returns zeros)
    input_ids, positions: the step's  | whatever an earlier step left (valid ids, positions)

The captured forward allocates only from the graphs' shared private pool (largest batch captured
first, so the smaller ones reuse its memory) and takes no host data. Sampling stays outside the
graph. Needs the CUDA kernels (engine.ops.KernelOps): the torch reference ops synchronize.
"""

from __future__ import annotations

import torch

from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import AttentionContext, padded_batch_size
from llmserve.engine.step.sampler import to_device


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every 8 up to 256, every 32 up to 512, every 64
    beyond, and max_num_seqs itself as the last (nothing larger is ever scheduled)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={max_num_seqs} must be >= 1")
    sizes = [1, 2, 4, 8]
    size = 8
    while size < max_num_seqs:
        size += 8 if size < 256 else 32 if size < 512 else 64
        sizes.append(size)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def is_decode_only(seq_lens: list[int], cu_seqlens_q: list[int]) -> bool:
    """Every request schedules exactly one token (each schedules at least one, so n rows with n
    tokens in all means one each)."""
    return len(seq_lens) > 0 and cu_seqlens_q[-1] == len(seq_lens)


class DecodeGraphs:
    """Static buffers for decode batches up to max(sizes), and one graph per size once
    `capture()` ran. Without capture (CPU tests), `run` executes the same forward eagerly on the
    same buffers, padding included."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_seq_len: int,
        device: torch.device,
    ):
        if not model.ops.graph_safe:
            raise ValueError(f"ops backend {model.ops.name!r} cannot be captured in a CUDA graph")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        # With DecodeSplits on the ops (the engine's), the split count of each size is theirs,
        # as an eager step's; else the kernel chooses from max_seq_len, fixed per graph.
        self.max_seq_len = max_seq_len
        self.device = device
        max_bs = self.sizes[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
            self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
            self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
            self.block_tables = torch.zeros(
                (max_bs, max_blocks_per_seq), dtype=torch.int32, device=device
            )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def context(self, size: int) -> AttentionContext:
        """The attention metadata of the first `size` rows of the static buffers."""
        decode_splits = getattr(self.model.ops, "decode_splits", None)
        return AttentionContext(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=[],
            cu_seqlens_q=[],
            kv_caches=self.kv_caches,
            seq_lens_t=self.seq_lens[:size],
            cu_seqlens_q_t=self.cu_seqlens_q[: size + 1],
            max_seqlen_q=1,
            max_seq_len=self.max_seq_len,
            num_splits=decode_splits(size) if decode_splits is not None else None,
        )

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the static buffers."""
        ctx = self.context(size)
        return self.model(self.input_ids[:size], self.positions[:size], ctx)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per size, largest first, into one shared memory pool. Each size
        runs once eagerly first (compiles the kernels, sets cuBLAS up for its shapes), on
        all-padding rows, so nothing in the KV pool changes."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def can_run(self, ctx: AttentionContext) -> bool:
        """Whether the step of `ctx` (host metadata from the runner) is a decode-only batch small
        enough for the captured sizes."""
        return len(ctx.seq_lens) <= self.sizes[-1] and is_decode_only(
            ctx.seq_lens, ctx.cu_seqlens_q
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode-only step: its inputs copied into the
        static buffers (device to device, plus the context lengths through pinned memory, so
        nothing waits for the device), padding rows reset, then the graph of the padded size
        replayed."""
        num_seqs = len(ctx.seq_lens)
        size = padded_batch_size(num_seqs, self.sizes)
        assert size is not None and is_decode_only(ctx.seq_lens, ctx.cu_seqlens_q)
        width = ctx.block_tables.shape[1]
        assert width <= self.block_tables.shape[1], (width, self.block_tables.shape)
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.slot_mapping[:num_seqs].copy_(ctx.slot_mapping)
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.seq_lens[:num_seqs].copy_(to_device(ctx.seq_lens, torch.int32, self.device))
        self.seq_lens[num_seqs:size].zero_()
        self.block_tables[:num_seqs, :width].copy_(ctx.block_tables)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:num_seqs]
        graph.replay()
        return self.outputs[size][:num_seqs]
