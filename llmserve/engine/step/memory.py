"""Sizing the KV pool. On a CPU (or with --num-kv-blocks / --kv-cache-gb) without profiling:
`choose_num_blocks`. On a GPU from what a profiling forward at the largest step leaves
(`profile_num_blocks`):

    |<------------------ total x gpu_memory_utilization ------------------>|
    |<- weights ->|<- activation peak ->|<- graphs ->|<- non-torch ->|<- KV pool ->|

The activation peak is measured (`profile_step_memory`: one step of max_num_batched_tokens
tokens over up to max_num_seqs requests, sampled with every filter on, into a scratch pool that
is not counted); the arithmetic (`kv_cache_budget`, `graph_memory_estimate`) is pure and tested
on the CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from llmserve.common.model_config import ModelConfig
from llmserve.common.step_plan import NewRequest, RunningColumns, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.mirror import Mirror
from llmserve.engine.kv.cache import allocate_kv_cache, bytes_per_block, layer_views
from llmserve.protos.common_pb2 import SamplingParams

GIB = 1 << 30
GRAPH_MARGIN_BYTES = 64 << 20
# The CPU pool's default: this many steps' worth of tokens, counting a step as at least
# CPU_POOL_STEP_TOKENS (16 x 2048 by default: 64 requests of 512 tokens, whatever the CPU's
# shorter default step), at most this share of the memory available at start.
CPU_POOL_STEPS = 16
CPU_POOL_STEP_TOKENS = 2048
CPU_POOL_MEMORY_SHARE = 0.25
# Every sampling feature at once, so the profile sees the sampler's largest temporaries
# (sort, softmax, noise and penalty counts over [max_num_seqs, vocab]).
PROFILE_SAMPLING = SamplingParams(
    temperature=1.0,
    top_k=50,
    top_p=0.9,
    min_p=0.05,
    logprobs=True,
    top_logprobs=20,
    presence_penalty=0.5,
    frequency_penalty=0.5,
)


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory in bytes, read around the profiling step."""

    total_bytes: int
    free_bytes: int  # free after the step, torch's cache emptied
    weights_bytes: int  # held by torch before the step: weights, rope table
    activation_peak_bytes: int  # the step's peak above that, its scratch KV pool excluded
    non_torch_bytes: int  # in use outside torch's allocator: CUDA context, CuPy modules, ...


def profile_lengths(
    max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int
) -> list[int]:
    """Prompt lengths of the profiling step: max_num_batched_tokens tokens over as few requests
    as max_model_len allows and as many as max_num_seqs allows (the most logits rows), evenly."""
    tokens = max_num_batched_tokens
    num_seqs = min(max_num_seqs, tokens)
    num_seqs = max(num_seqs, -(-tokens // max_model_len))
    base, extra = divmod(tokens, num_seqs)
    return [base + 1] * extra + [base] * (num_seqs - extra)


def graph_memory_estimate(
    activation_peak_bytes: int, max_graph_batch: int, profiled_tokens: int
) -> int:
    """What the decode graphs' private pool will hold: activations grow with the tokens in a
    forward, so the profile's peak scaled down to the largest captured batch (an overestimate:
    that peak also holds the sampler's [rows, vocab] temporaries), plus a fixed margin."""
    if max_graph_batch <= 0:
        return 0
    share = min(1.0, max_graph_batch / max(profiled_tokens, 1))
    return int(activation_peak_bytes * share) + GRAPH_MARGIN_BYTES


def kv_cache_budget(profile: MemoryProfile, utilization: float, graph_bytes: int) -> int:
    """Bytes the KV pool may take: utilization x total less everything else the engine keeps,
    and never more than is free now less the room the steps and graphs will need again (another
    process may hold memory too). 0 when nothing is left."""
    p = profile
    steps_and_graphs = p.activation_peak_bytes + graph_bytes
    wanted = int(utilization * p.total_bytes) - p.weights_bytes - p.non_torch_bytes
    return max(0, min(wanted, p.free_bytes) - steps_and_graphs)


def num_blocks_for(budget_bytes: int, bytes_per_block: int) -> int:
    return max(0, budget_bytes // bytes_per_block)


def describe(profile: MemoryProfile) -> dict[str, float]:
    """The profile in GiB, for the engine's log line: total_gib, free_gib, ..."""
    return {
        f.name.replace("_bytes", "_gib"): round(getattr(profile, f.name) / GIB, 2)
        for f in fields(profile)
    }


def profile_plan(lengths: list[int], block_size: int, vocab_size: int) -> StepPlanData:
    """One step admitting len(lengths) whole prompts, blocks handed out in order."""
    new: list[NewRequest] = []
    next_block = 0
    for seq_id, length in enumerate(lengths):
        num_blocks = -(-length // block_size)
        table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        tokens = [(seq_id * 7919 + i * 104729) % vocab_size for i in range(length)]
        new.append(NewRequest(seq_id, tokens, length, PROFILE_SAMPLING, table, 0, length))
    return StepPlanData(1, [], new, RunningColumns([], [], [], [], []))


@torch.inference_mode()
def profile_step_memory(
    model_config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    lengths: list[int],
    make_runner: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any],
) -> MemoryProfile:
    """Run one step of prompts `lengths` through a runner (from make_runner(kv views)) on a
    scratch KV pool of `dtype` just large enough, and read the device's memory around it. The
    scratch pool and everything the step allocated are freed before returning."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights_bytes = torch.cuda.memory_allocated(device)
    plan = profile_plan(lengths, block_size, model_config.vocab_size)
    num_blocks = sum(-(-n // block_size) for n in lengths)
    scratch = allocate_kv_cache(model_config, num_blocks, block_size, dtype, device)
    scratch_bytes = scratch.numel() * scratch.element_size()
    runner = make_runner(layer_views(scratch))
    runner.execute(Mirror(block_size, num_blocks).apply(plan))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights_bytes - scratch_bytes
    del runner, scratch
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return MemoryProfile(total, free, weights_bytes, max(0, peak), non_torch)


def available_memory_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux), else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def give_back_freed_memory() -> None:
    """Return the heap glibc keeps after loading (a GGUF's float32 copies) to the OS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def pool_bytes_per_block(
    model_configs: list[ModelConfig], block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes in every pool: the target's and, with a draft model, the draft's
    (its pool has as many blocks)."""
    return sum(bytes_per_block(c, block_size, dtype) for c in model_configs)


def choose_num_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    ranks_on_node: int = 1,
    draft_config: ModelConfig | None = None,
) -> int:
    """The KV pool's size without profiling: --num-kv-blocks, --kv-cache-gb, or on the CPU by
    default CPU_POOL_STEPS steps of max_num_batched_tokens tokens, a step counted as at least
    CPU_POOL_STEP_TOKENS (and at least one max_model_len request), capped at
    CPU_POOL_MEMORY_SHARE of the available memory, shared by this node's ranks (a GPU
    engine profiles instead: `profile_num_blocks`). dtype: the pool's; model_config: the shape
    of this rank's part; draft_config: a draft model's, whose pool has as many blocks (the
    memory is for both pools)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    configs = [model_config] if draft_config is None else [model_config, draft_config]
    per_block = pool_bytes_per_block(configs, config.block_size, dtype)
    if config.kv_cache_gb:
        budget = int(config.kv_cache_gb * GIB)
    else:
        max_len = min(model_config.max_position_embeddings, config.max_model_len or 1 << 62)
        step = max(config.max_num_batched_tokens, CPU_POOL_STEP_TOKENS)
        tokens = max(CPU_POOL_STEPS * step, max_len)
        wanted = -(-tokens // config.block_size) * per_block
        share = CPU_POOL_MEMORY_SHARE / ranks_on_node
        budget = min(wanted, int(share * available_memory_bytes()))
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise RuntimeError(
            f"kv_cache_gb={config.kv_cache_gb} holds no block ({per_block} bytes per block)"
        )
    return num_blocks


# A model whose pool is sized and a runner of it over given KV layer views (for the profile).
PooledModel = tuple[ModelConfig, Callable[[list[tuple[torch.Tensor, torch.Tensor]]], Any]]


def profile_num_blocks(
    config: EngineConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    models: list[PooledModel],
    max_graph_batch: int,
) -> tuple[int, dict[str, float]]:
    """(num_blocks, memory figures for the log) on a GPU, from a profiling step at the
    scheduler's largest through each of `models` (the target's part on this rank first, then a
    draft model's, whose weights are in the target's profile already: its forwards, catch-up
    chunks of at most max_num_batched_tokens tokens, run after the target's, not beside them).
    dtype: the pools'; max_graph_batch: the largest decode batch captured (0: no graphs)."""
    c = config
    lengths = profile_lengths(c.max_num_batched_tokens, c.max_num_seqs, max_model_len)
    profiles = [
        profile_step_memory(model_config, dtype, device, c.block_size, lengths, make_runner)
        for model_config, make_runner in models
    ]
    peak = max(p.activation_peak_bytes for p in profiles)
    profile = replace(profiles[0], activation_peak_bytes=peak)
    graph_bytes = graph_memory_estimate(
        profile.activation_peak_bytes, max_graph_batch, sum(lengths)
    )
    budget = kv_cache_budget(profile, c.gpu_memory_utilization, graph_bytes)
    per_block = pool_bytes_per_block([m for m, _ in models], c.block_size, dtype)
    num_blocks = num_blocks_for(budget, per_block)
    figures = {**describe(profile), "graph_reserve_gib": round(graph_bytes / GIB, 2)}
    if num_blocks < 1:
        raise RuntimeError(
            f"no GPU memory left for the KV pool at gpu_memory_utilization="
            f"{c.gpu_memory_utilization} (GiB: {figures}); raise it or lower "
            f"max_num_batched_tokens={c.max_num_batched_tokens}"
        )
    return num_blocks, figures
