"""The engine proper: loads the model and the KV pool once, then executes plans one at a time.

Steps run in plan order. `launch` enqueues a step without waiting for the device, so the next
plan can be launched while it runs (its inputs gathered from this step's tokens on the device);
`finish` waits for a step's output. At most one launched step is left unresolved (tokens not on
the host) when the next is launched: an older one is finished first.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

import torch

from common.log import get_logger
from common.model_config import (
    ModelConfig,
    ModelSourceError,
    check_draft_model,
    load_model_config,
    resolve_model_path,
)
from common.sampling import has_penalties
from engine.config import EngineConfig
from engine.contract import EngineInfo, StepOutput, StepPlanData, with_refused_rows
from engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from engine.kv_cache import allocate_kv_cache, bytes_per_block, layer_views
from engine.memory import (
    GIB,
    describe,
    graph_memory_estimate,
    kv_cache_budget,
    num_blocks_for,
    profile_lengths,
    profile_step_memory,
)
from engine.mirror import Mirror, StepBatch
from engine.model import LlamaForCausalLM
from engine.ops import select_ops
from engine.parallel import Parallel, shard_config, whole_model
from engine.proposer import make_proposer
from engine.quant import quantization_limits
from engine.runner import LaunchedStep, ModelRunner, StepTimer
from engine.sampler import Sampler
from engine.timeline import Timeline, make_timeline
from engine.weights import build_model, load_weights, resolve_quantization

log = get_logger("engine")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)  # one of engine.config.DTYPES


KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
# The CPU pool's default: this many steps' worth of tokens (16 x 2048 by default: 64 requests of
# 512 tokens), at most this share of the memory available at start.
CPU_POOL_STEPS = 16
CPU_POOL_MEMORY_SHARE = 0.25


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if name == "auto" else KV_CACHE_DTYPES[name]


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


def choose_num_blocks(
    config: EngineConfig,
    model_config: ModelConfig,
    dtype: torch.dtype,
    ranks_on_node: int = 1,
    draft_config: ModelConfig | None = None,
) -> int:
    """The KV pool's size without profiling: --num-kv-blocks, --kv-cache-gb, or on the CPU by
    default CPU_POOL_STEPS x max_num_batched_tokens tokens (at least one max_model_len request),
    capped at CPU_POOL_MEMORY_SHARE of the available memory, shared by this node's ranks (a GPU
    engine profiles instead: Engine._size_kv_pool). dtype: the pool's; model_config: the shape
    of this rank's part; draft_config: a draft model's, whose pool has as many blocks (the
    memory is for both pools)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = bytes_per_block(model_config, config.block_size, dtype)
    if draft_config is not None:
        per_block += bytes_per_block(draft_config, config.block_size, dtype)
    if config.kv_cache_gb:
        budget = int(config.kv_cache_gb * GIB)
    else:
        max_len = min(model_config.max_position_embeddings, config.max_model_len or 1 << 62)
        tokens = max(CPU_POOL_STEPS * config.max_num_batched_tokens, max_len)
        wanted = -(-tokens // config.block_size) * per_block
        share = CPU_POOL_MEMORY_SHARE / ranks_on_node
        budget = min(wanted, int(share * available_memory_bytes()))
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise RuntimeError(
            f"kv_cache_gb={config.kv_cache_gb} holds no block ({per_block} bytes per block)"
        )
    return num_blocks


def _give_back_freed_memory() -> None:
    """Return the heap glibc keeps after loading (a GGUF's float32 copies) to the OS."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class Engine:
    def __init__(self, config: EngineConfig, parallel: Parallel | None = None):
        """parallel: this rank's engine group (engine.parallel), joined already, when the model
        is split across ranks; the engine then holds its shard and runs its part of each step."""
        self.config = config
        self.parallel = parallel
        # Unseeded requests draw from this; a fresh one each start unless --seed fixes it.
        self.sampling_seed = secrets.randbits(63) if config.seed is None else config.seed
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        path = resolve_model_path(config.model)
        self.model_config = load_model_config(path)
        num_layers = self.model_config.num_layers
        self.shard = parallel.shard if parallel is not None else whole_model(num_layers)
        # The shape of this rank's part: its heads and layers (the whole model's without parallel).
        self.local_config = shard_config(self.model_config, self.shard)
        self.device = resolve_device(config.device) if parallel is None else parallel.device
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.quantization = resolve_quantization(config.quantization, path, self.device)
        why_not = quantization_limits(self.quantization, self.device)
        if why_not:
            raise ValueError(why_not)
        max_len = self.model_config.max_position_embeddings
        self.max_model_len = max_len = min(max_len, config.max_model_len or max_len)
        draft_source = self._draft_source(path)
        ops, ops_reason = select_ops(
            config.attention_backend, self.device, self.dtype, self.local_config, config.block_size
        )
        self.ops_reason = ops_reason  # recorded by the benchmarks beside their figures
        ops.fix_decode_splits(self.local_config, max_len, graph_batch_sizes(config.max_num_seqs))
        if (
            self.device.type == "cuda"
            and ops.name == "torch"
            and config.attention_backend == "auto"
        ):
            log.warning("attention backend: plain torch, not the CUDA kernels", why=ops_reason)
        weights = None if config.load_format == "dummy" else load_weights(path, self.model_config)
        self.model = build_model(
            self.model_config, weights, max_len, self.dtype, self.device,
            dummy_seed=config.seed or 0, ops=ops, quantization=self.quantization,
            shard=self.shard,
        )  # fmt: skip
        del weights
        self.draft_model = self._load_draft(*draft_source) if draft_source else None
        self.draft_config = self.draft_model.config if self.draft_model is not None else None
        if self.device.type == "cpu":
            _give_back_freed_memory()
        load_s = time.perf_counter() - t0
        self.num_blocks, memory = self._size_kv_pool()
        if parallel is not None:  # one block space: every rank's pool holds the same blocks
            self.num_blocks = parallel.min_over_ranks(self.num_blocks)
        self.kv_cache = allocate_kv_cache(
            self.local_config, self.num_blocks, config.block_size, self.kv_dtype, self.device
        )
        kv_caches = layer_views(self.kv_cache)
        # The draft model's pool: its own layers and heads, the target's blocks.
        self.draft_kv_cache = None
        draft_kv_caches = None
        if self.draft_config is not None:
            self.draft_kv_cache = allocate_kv_cache(
                self.draft_config, self.num_blocks, config.block_size, self.kv_dtype, self.device
            )
            draft_kv_caches = layer_views(self.draft_kv_cache)
        graphs, graph_info = self._capture_graphs(kv_caches)
        self.timeline: Timeline = make_timeline(self.device)
        self.runner = self._make_runner(kv_caches, graphs=graphs, timeline=self.timeline)
        self.proposer = make_proposer(
            config, self.model, kv_caches, self.draft_model, draft_kv_caches
        )
        # Launched steps whose tokens are not on the host yet, oldest first.
        self.unresolved: deque[LaunchedStep] = deque()
        self.reset()
        self.info = EngineInfo(
            model=self.model_config.name,
            vocab_size=self.model_config.vocab_size,
            max_model_len=max_len,
            eos_token_ids=self.model_config.eos_token_ids,
            block_size=config.block_size,
            num_blocks=self.num_blocks,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            speculative_method=self.proposer.name if self.proposer is not None else "",
            num_speculative_tokens=config.num_speculative_tokens
            if self.proposer is not None
            else 0,
        )
        log.info(
            "engine loaded",
            model=str(path),
            load_format=config.load_format,
            device=str(self.device),
            dtype=self.info.dtype,
            quantization=self.quantization,
            speculative_method=self.info.speculative_method or "none",
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            ops=ops.name,
            ops_reason=ops_reason,
            num_blocks=self.num_blocks,
            kv_tokens=self.num_blocks * config.block_size,
            kv_cache_gib=round(self.kv_cache.numel() * self.kv_cache.element_size() / GIB, 2),
            **self._draft_figures(),
            max_model_len=max_len,
            load_s=round(load_s, 2),
            total_s=round(time.perf_counter() - t0, 2),
            **memory,
            **graph_info,
        )

    def _draft_source(self, target_path: Path) -> tuple[Path, ModelConfig] | None:
        """The --speculative-model's path and shape, checked against the target's before any
        weights load (ModelSourceError naming both when they cannot pair); None without one."""
        if not self.config.speculative_model:
            return None
        path = resolve_model_path(self.config.speculative_model, "--speculative-model")
        draft_config = load_model_config(path)
        check_draft_model(target_path, self.model_config, path, draft_config)
        if draft_config.max_position_embeddings < self.max_model_len:
            raise ModelSourceError(
                f"speculative_model {path}: max_position_embeddings="
                f"{draft_config.max_position_embeddings} is below the engine's max_model_len="
                f"{self.max_model_len}; lower --max-model-len"
            )
        return path, draft_config

    def _load_draft(self, path: Path, draft_config: ModelConfig) -> LlamaForCausalLM:
        """The draft model, built as the target is: same device, dtype, load format (dummy:
        seeded as the target's) and quantization rule (auto resolved for its own file), the
        layer ops chosen for its own shape."""
        c = self.config
        quantization = resolve_quantization(c.quantization, path, self.device)
        why_not = quantization_limits(quantization, self.device)
        if why_not:
            raise ValueError(f"speculative_model {path}: {why_not}")
        ops, _ = select_ops(
            c.attention_backend, self.device, self.dtype, draft_config, c.block_size
        )
        weights = None if c.load_format == "dummy" else load_weights(path, draft_config)
        return build_model(
            draft_config, weights, self.max_model_len, self.dtype, self.device,
            dummy_seed=c.seed or 0, ops=ops, quantization=quantization,
        )  # fmt: skip

    def _draft_figures(self) -> dict[str, object]:
        """The draft model's entries of the engine's log line (none without one)."""
        if self.draft_model is None or self.draft_kv_cache is None:
            return {}
        pool = self.draft_kv_cache
        return {
            "speculative_model": self.config.speculative_model,
            "draft_num_layers": self.draft_model.config.num_layers,
            "draft_kv_cache_gib": round(pool.numel() * pool.element_size() / GIB, 2),
        }

    def _make_runner(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        graphs: DecodeGraphs | None = None,
        timeline: Timeline | None = None,
    ) -> ModelRunner:
        return ModelRunner(
            self.model,
            kv_caches,
            self.config.block_size,
            self.device,
            Sampler(self.device, self.sampling_seed),
            graphs=graphs,
            timeline=timeline,
            parallel=self.parallel,
        )

    def _make_draft_runner(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> ModelRunner:
        """A runner of the draft model, for the memory profile."""
        assert self.draft_model is not None
        sampler = Sampler(self.device, self.sampling_seed)
        return ModelRunner(
            self.draft_model, kv_caches, self.config.block_size, self.device, sampler
        )

    def _uses_graphs(self) -> tuple[bool, str]:
        if self.device.type != "cuda":
            return False, f"device {self.device.type}"
        if self.parallel is not None:
            return False, "tensor / pipeline parallel (collectives are not captured yet)"
        if self.config.enforce_eager:
            return False, "--enforce-eager"
        if not self.model.ops.graph_safe:
            return False, f"ops backend {self.model.ops.name} (the CUDA kernels are needed)"
        return True, ""

    def _size_kv_pool(self) -> tuple[int, dict[str, float]]:
        """(num_blocks, memory figures for the log). On a GPU without --num-kv-blocks: from a
        profiling step at the scheduler's largest (engine.memory)."""
        c = self.config
        if self.device.type != "cuda" or c.num_kv_blocks:
            ranks = self.parallel.ranks_on_node if self.parallel is not None else 1
            return choose_num_blocks(
                c, self.local_config, self.kv_dtype, ranks, self.draft_config
            ), {}
        lengths = profile_lengths(c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len)
        profile = profile_step_memory(
            self.local_config, self.kv_dtype, self.device, c.block_size, lengths, self._make_runner
        )
        if self.draft_model is not None and self.draft_config is not None:
            # Its weights are in the profile's already; its forwards (catch-up chunks of at
            # most max_num_batched_tokens tokens) run after the target's, not beside them.
            draft = profile_step_memory(
                self.draft_config, self.kv_dtype, self.device, c.block_size, lengths,
                self._make_draft_runner,
            )  # fmt: skip
            peak = max(profile.activation_peak_bytes, draft.activation_peak_bytes)
            profile = replace(profile, activation_peak_bytes=peak)
        uses_graphs, _ = self._uses_graphs()
        max_graph_batch = graph_batch_sizes(c.max_num_seqs)[-1] if uses_graphs else 0
        graph_bytes = graph_memory_estimate(
            profile.activation_peak_bytes, max_graph_batch, sum(lengths)
        )
        budget = kv_cache_budget(profile, c.gpu_memory_utilization, graph_bytes)
        per_block = bytes_per_block(self.local_config, c.block_size, self.kv_dtype)
        if self.draft_config is not None:  # as many blocks in the draft's pool
            per_block += bytes_per_block(self.draft_config, c.block_size, self.kv_dtype)
        num_blocks = num_blocks_for(budget, per_block)
        figures = {**describe(profile), "graph_reserve_gib": round(graph_bytes / GIB, 2)}
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV pool at gpu_memory_utilization="
                f"{c.gpu_memory_utilization} (GiB: {figures}); raise it or lower "
                f"max_num_batched_tokens={c.max_num_batched_tokens}"
            )
        return num_blocks, figures

    def _capture_graphs(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[DecodeGraphs | None, dict[str, object]]:
        uses_graphs, why_not = self._uses_graphs()
        if not uses_graphs:
            return None, {"cuda_graphs": f"off: {why_not}"}
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved(self.device)
        sizes = graph_batch_sizes(self.config.max_num_seqs)
        graphs = DecodeGraphs(
            self.model,
            kv_caches,
            sizes,
            max_blocks_per_seq=-(-self.max_model_len // self.config.block_size),
            max_seq_len=self.max_model_len,
            device=self.device,
        )
        graphs.capture()
        return graphs, {
            "cuda_graphs": f"{len(sizes)} decode batch sizes, 1..{sizes[-1]}",
            "graph_capture_s": round(time.perf_counter() - t0, 2),
            "graph_memory_gib": round(
                (torch.cuda.memory_reserved(self.device) - reserved) / GIB, 2
            ),
        }

    def reset(self) -> None:
        """Forget every request (a new Step stream starts from nothing)."""
        self.mirror = Mirror(self.config.block_size, self.num_blocks, self.model_config.vocab_size)
        self.unresolved.clear()

    def step(self, plan: StepPlanData) -> StepOutput:
        """Apply plan to the mirror, run it, commit the sampled tokens.

        Raises MirrorMismatch (mirror possibly half-updated) when the plan disagrees."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlanData) -> LaunchedStep:
        """Apply plan to the mirror and enqueue its step; the mirror commits it at once, with
        placeholders for the tokens (`finish` resolves them). Raises MirrorMismatch (mirror
        possibly half-updated) when the plan disagrees."""
        while len(self.unresolved) > 1:
            self._resolve_oldest()
        batch = self.mirror.apply(plan)
        if batch.has_lookahead:
            return self._speculate(batch)
        if self.unresolved and _needs_host_tokens(batch):
            self._resolve_oldest()
        if not batch.rows:
            return _empty_step(batch)
        step = self.runner.launch(batch, self.unresolved[-1] if self.unresolved else None)
        self.mirror.commit_pending(batch)
        self.unresolved.append(step)
        return step

    def _speculate(self, batch: StepBatch) -> LaunchedStep:
        """Run a step with lookahead slots to its end: propose tokens from the requests' known
        ones (steps before it resolved first), verify them in one forward, commit every token
        the rows return. Nothing of it stays on the device for the next step."""
        while self.unresolved:
            self._resolve_oldest()
        if self.proposer is not None:
            self.proposer.propose(batch)
        output, tokens = self.runner.verify(batch)
        self.mirror.commit_tokens(batch, tokens)
        step = _empty_step(batch)
        step.output = with_refused_rows(output, batch.refusals)
        return step

    def finish(self, step: LaunchedStep) -> StepOutput:
        """step's output, waiting for it (and for the steps launched before it)."""
        while step.output is None:
            self._resolve_oldest()
        return step.output

    def _resolve_oldest(self) -> None:
        step = self.unresolved.popleft()
        output = self.runner.collect(step)
        self.mirror.resolve(step.batch, output.sampled_token_ids)
        step.output = with_refused_rows(output, step.batch.refusals)


def _needs_host_tokens(batch: StepBatch) -> bool:
    """Whether a row reads its generated tokens' values on the host (penalties count them)
    while one may still be a placeholder."""
    return any(r.seq.pending_row >= 0 and has_penalties(r.seq.sampling) for r in batch.rows)


def _empty_step(batch: StepBatch) -> LaunchedStep:
    """A step with no rows (it only dropped finished requests): nothing to run."""
    empty = torch.empty(0, dtype=torch.long)
    step = LaunchedStep(batch, StepTimer(empty.device, 0.0), empty, (empty, None, None, None))
    step.output = with_refused_rows(StepOutput([], None, 0.0, 0.0), batch.refusals)
    return step
