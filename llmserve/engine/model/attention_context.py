"""AttentionContext: one step's attention metadata, which the runner builds and every layer's
ops read (engine/model/ops.py, where the layers find it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionContext:
    """Per-step attention metadata, built once by the runner and read by every layer.

    slot_mapping[t]: KV slot of token t; block_tables: [num_seqs, max_blocks]; seq_lens[b]: context
    length of request b including this step's tokens; cu_seqlens_q: B+1 offsets of each request's
    tokens in the flattened batch. kv_caches[layer] = (k_cache, v_cache).

    The CUDA kernels (engine.ops.KernelOps) read the same metadata from the device: seq_lens_t and
    cu_seqlens_q_t (int32), block_tables as int32, and the step's max_seqlen_q / max_seq_len, so
    they never synchronize. KernelOps.prepare fills these from the lists; a CUDA graph's context
    gives them as static buffers (and empty lists).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    cu_seqlens_q: list[int]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    seq_lens_t: torch.Tensor | None = None
    cu_seqlens_q_t: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seq_len: int = 0
    cpu_step: Any = None  # CpuOps' per-step metadata (engine.ops._CpuStep)
    # The decode kernel's split-K count for a decode-only step (KernelOps with DecodeSplits);
    # None: the kernel chooses from max_seq_len.
    num_splits: int | None = None
    # The step's adapters (engine.lora.LoraBatch): the projections add each row's low-rank
    # update; None when no row uses one.
    lora: Any = None
    # Hybrid linear-attention models: the rows' state slots (engine/kv/state.py's StateBatch);
    # None for a model without state layers, or a step with no pool (the memory profile).
    state: Any = None
    # Speculation's token trees (engine/features/token_tree.py), per request: (mask [num_q,
    # seq_len] of the keys each query sees, the keys' rotary positions [seq_len]) in place of
    # the causal mask, or None for a causal request; None when no request has a tree.
    tree_masks: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # The same for the CUDA prefill kernel: per query token the tree nodes it sees (bit i: node
    # i; int64), per request the position of its first node (beyond its keys: none).
    tree_bits: torch.Tensor | None = None
    tree_start: torch.Tensor | None = None
