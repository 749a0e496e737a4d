"""Whether the engine replays decode steps from CUDA graphs, and capturing them at start
(engine/step/cuda_graphs.py holds the graphs themselves)."""

from __future__ import annotations

import time

import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.parallel.groups import Parallel
from llmserve.engine.step.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llmserve.engine.step.memory import GIB


def uses_graphs(
    config: EngineConfig, device: torch.device, model: LlamaForCausalLM, parallel: Parallel | None
) -> tuple[bool, str]:
    """(whether decode steps replay from graphs, why not when they do not)."""
    if device.type != "cuda":
        return False, f"device {device.type}"
    if parallel is not None:
        return False, "tensor / pipeline parallel (collectives are not captured yet)"
    if config.enforce_eager:
        return False, "--enforce-eager"
    if not model.ops.graph_safe:
        return False, f"ops backend {model.ops.name} (the CUDA kernels are needed)"
    return True, ""


def capture_graphs(
    config: EngineConfig,
    device: torch.device,
    model: LlamaForCausalLM,
    parallel: Parallel | None,
    max_model_len: int,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[DecodeGraphs | None, dict[str, object]]:
    """The decode graphs over kv_caches (None where they are not used), and figures for the
    engine's log line."""
    using, why_not = uses_graphs(config, device, model, parallel)
    if not using:
        return None, {"cuda_graphs": f"off: {why_not}"}
    t0 = time.perf_counter()
    reserved = torch.cuda.memory_reserved(device)
    sizes = graph_batch_sizes(config.max_num_seqs)
    graphs = DecodeGraphs(
        model,
        kv_caches,
        sizes,
        max_blocks_per_seq=-(-max_model_len // config.block_size),
        max_seq_len=max_model_len,
        device=device,
    )
    graphs.capture()
    return graphs, {
        "cuda_graphs": f"{len(sizes)} decode batch sizes, 1..{sizes[-1]}",
        "graph_capture_s": round(time.perf_counter() - t0, 2),
        "graph_memory_gib": round((torch.cuda.memory_reserved(device) - reserved) / GIB, 2),
    }
