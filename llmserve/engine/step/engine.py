"""The engine proper: loads the model and the KV pool once, then executes plans one at a time.

Steps run in plan order. `launch` enqueues a step without waiting for the device, so the next
plan can be launched while it runs (its inputs gathered from this step's tokens on the device);
`finish` waits for a step's output. At most one launched step is left unresolved (tokens not on
the host) when the next is launched: an older one is finished first.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from llmserve.common.families import family_refusal
from llmserve.common.log import get_logger
from llmserve.common.model_config import (
    ModelConfig,
    ModelSourceError,
    check_draft_model,
    load_model_config,
    resolve_model_path,
)
from llmserve.common.sampling import has_penalties
from llmserve.common.step_plan import StepOutput, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.contract import EngineInfo, with_refused_rows
from llmserve.engine.contract.mirror import Mirror, MirrorMismatch, StepBatch
from llmserve.engine.features.adapters import Adapters
from llmserve.engine.features.grammar import Grammars
from llmserve.engine.features.lora_files import LoraAdapter, LoraError
from llmserve.engine.features.proposer import make_proposer
from llmserve.engine.kv.cache import allocate_kv_cache, bytes_per_block, layer_views
from llmserve.engine.kv.disaggregation import KVTransfers
from llmserve.engine.kv.offload import KVTiers
from llmserve.engine.kv.state import StatePool, state_bytes_per_slot
from llmserve.engine.model.checkpoint_formats import checkpoint_format
from llmserve.engine.model.checkpoint_linear import kept_description
from llmserve.engine.model.checkpoint_linear_cuda import gpu_kept_description
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.weights import checked_quantization, load_model
from llmserve.engine.parallel.groups import Parallel, shard_config, whole_model
from llmserve.engine.step.cpu_threads import set_torch_threads
from llmserve.engine.step.cuda_graphs import DecodeGraphs, graph_batch_sizes
from llmserve.engine.step.device import resolve_device, resolve_dtype, resolve_kv_dtype
from llmserve.engine.step.graph_capture import capture_graphs, uses_graphs
from llmserve.engine.step.memory import (
    GIB,
    PooledModel,
    choose_num_blocks,
    give_back_freed_memory,
    profile_num_blocks,
)
from llmserve.engine.step.runner import LaunchedStep, ModelRunner, StepTimer
from llmserve.engine.step.sampler import Sampler
from llmserve.engine.step.timeline import Timeline, make_timeline

log = get_logger("engine")

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# How long a step with no rows (the scheduler asking whether grammars are compiled) may wait
# for a compile to end before answering: it bounds the asking to a few per 100 ms.
IDLE_COMPILE_WAIT_S = 0.02


class Engine:
    def __init__(self, config: EngineConfig, parallel: Parallel | None = None):
        """parallel: this rank's engine group (engine.parallel), joined already, when the model
        is split across ranks; the engine then holds its shard and runs its part of each step."""
        self.config = config
        self.parallel = parallel
        # Unseeded requests draw from this; a fresh one each start unless --seed fixes it.
        self.sampling_seed = secrets.randbits(63) if config.seed is None else config.seed
        set_torch_threads(config.num_threads, config.device)
        t0 = time.perf_counter()
        path = resolve_model_path(config.model)
        config = self._resolve_target(path)  # its step budget resolved for the device
        draft_source = self._draft_source(path)
        self.model, self.ops_reason = load_model(
            config, path, self.model_config, self.quantization, self.max_model_len,
            self.dtype, self.device, self.shard,
        )  # fmt: skip
        if (
            self.device.type == "cuda"
            and self.model.ops.name == "torch"
            and config.attention_backend == "auto"
        ):
            log.warning("attention backend: plain torch, not the CUDA kernels", why=self.ops_reason)
        self.adapters = (
            Adapters(config, self.model_config, self.shard, self.dtype, self.device, self.model.ops)
            if config.max_loras
            else None
        )
        self.draft_model = self._load_draft(*draft_source) if draft_source else None
        self.draft_config = self.draft_model.config if self.draft_model is not None else None
        if self.device.type == "cpu":
            give_back_freed_memory()
        load_s = time.perf_counter() - t0
        memory = self._allocate_pools()
        self.tiers = self._allocate_tiers()
        self.transfers = KVTransfers.for_engine(self.kv_cache, config)
        kv_caches = layer_views(self.kv_cache)
        graphs, graph_info = capture_graphs(
            config, self.device, self.model, parallel, self.max_model_len, kv_caches
        )
        self.timeline: Timeline = make_timeline(self.device)
        self.grammars = Grammars(
            path, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.runner = self._make_runner(
            self.model, kv_caches, graphs=graphs, timeline=self.timeline, parallel=parallel,
            grammars=self.grammars,
        )  # fmt: skip
        self.runner.lora = self.adapters.slots if self.adapters is not None else None
        self.runner.state_pool = self.state_pool
        draft_kv_caches = None
        if self.draft_kv_cache is not None:
            draft_kv_caches = layer_views(self.draft_kv_cache)
        self.proposer = make_proposer(
            config, self.model, kv_caches, self.draft_model, draft_kv_caches
        )
        # Launched steps whose tokens are not on the host yet, oldest first.
        self.unresolved: deque[LaunchedStep] = deque()
        self.reset()
        self.info = self._engine_info()
        self._log_loaded(path, self.ops_reason, load_s, t0, memory, graph_info)

    def _resolve_target(self, path: Path) -> EngineConfig:
        """The target model's shape (the whole and this rank's part), the device, the dtypes
        and the quantization, checked before any weights load; returns the config with its
        step budget resolved for the device (also self.config)."""
        config, parallel = self.config, self.parallel
        self.model_config = load_model_config(path)
        why_not = family_refusal(self.model_config.family, config.features())
        if why_not:
            raise ModelSourceError(why_not)
        if self.model_config.state_layout is not None and config.engine_role != "both":
            raise ModelSourceError(
                f"engine_role={config.engine_role}: model family {self.model_config.family} "
                "keeps a recurrent state per request, which a KV transfer does not carry"
            )
        num_layers = self.model_config.num_layers
        self.shard = parallel.shard if parallel is not None else whole_model(num_layers)
        # The shape of this rank's part: its heads and layers (the whole model's without parallel).
        self.local_config = shard_config(self.model_config, self.shard)
        self.device = resolve_device(config.device) if parallel is None else parallel.device
        tokens = config.step_tokens(self.device.type)
        self.config = config = replace(config, max_num_batched_tokens=tokens)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.quantization = checked_quantization(
            config.quantization, path, self.device, whole=self.shard.tp.size == 1,
            dummy=config.load_format == "dummy",
        )  # fmt: skip
        if family_refusal(self.model_config.family, ["quantization"]):
            self.quantization = "none"  # what auto chose (one asked for was refused above)
        max_len = self.model_config.max_position_embeddings
        self.max_model_len = min(max_len, config.max_model_len or max_len)
        return config

    def _engine_info(self) -> EngineInfo:
        config = self.config
        speculates = self.proposer is not None
        return EngineInfo(
            model=self.model_config.name,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
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
            num_speculative_tokens=config.num_lookahead_slots if speculates else 0,
            sliding_window=self._released_window(),
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank if config.max_loras else 0,
            num_host_blocks=self.tiers.num_host_blocks if self.tiers else 0,
            num_disk_blocks=self.tiers.num_disk_blocks if self.tiers else 0,
            kv_block_bytes=bytes_per_block(self.local_config, config.block_size, self.kv_dtype),
            engine_role=config.engine_role,
            kv_transfer_address=self.transfers.address,
            num_state_slots=self.state_pool.num_slots if self.state_pool is not None else 0,
            num_state_snapshot_slots=(
                self.state_pool.num_snapshot_slots if self.state_pool is not None else 0
            ),
        )

    def _released_window(self) -> int:
        """The window the scheduler may release blocks out of: the model's when every layer
        has it, unless a separate draft model (whose pool shares the block ids) reads whole
        contexts; 0 for none."""
        return 0 if self.draft_model else self.model_config.uniform_window or 0

    def _log_loaded(
        self,
        path: Path,
        ops_reason: str,
        load_s: float,
        t0: float,
        memory: dict[str, float],
        graph_info: dict[str, object],
    ) -> None:
        """The engine's one log line at start: what it loaded, where, and the memory it took."""
        config = self.config
        blocks = "projections in GGUF blocks" if self.quantization == "gguf" else ""
        kept = kept_description(self.model) or gpu_kept_description(self.model) or blocks
        log.info(
            "engine loaded",
            model=str(path),
            load_format=config.load_format,
            device=str(self.device),
            dtype=self.info.dtype,
            quantization=self.quantization,
            checkpoint_format=(
                "none" if config.load_format == "dummy" else checkpoint_format(path, kept)
            ),
            speculative_method=self.info.speculative_method or "none",
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            ops=self.model.ops.name,
            ops_reason=ops_reason,
            num_blocks=self.num_blocks,
            kv_tokens=self.num_blocks * config.block_size,
            kv_bytes_per_token=self.info.kv_block_bytes // config.block_size,
            kv_cache_gib=round(self.kv_cache.numel() * self.kv_cache.element_size() / GIB, 2),
            kv_offload_host_blocks=self.info.num_host_blocks,
            kv_offload_disk_blocks=self.info.num_disk_blocks,
            **self._state_figures(),
            **self._draft_figures(),
            **(self.model.weight_path.figures() if self.model.weight_path else {}),
            max_model_len=self.max_model_len,
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
        what = f"speculative_model {path}: "
        quantization = checked_quantization(
            self.config.quantization, path, self.device, what,
            dummy=self.config.load_format == "dummy",
        )  # fmt: skip
        model, _ = load_model(
            self.config, path, draft_config, quantization, self.max_model_len, self.dtype,
            self.device,
        )  # fmt: skip
        return model

    def _state_figures(self) -> dict[str, object]:
        """The state pool's entries of the engine's log line (none without one)."""
        if self.state_pool is None:
            return {}
        return {
            "num_state_slots": self.state_pool.num_slots,
            "state_cache_gib": round(self.state_pool.nbytes / GIB, 3),
            "num_state_snapshot_slots": self.state_pool.num_snapshot_slots,
            "prefix_caching": "with state snapshots"
            if self.state_pool.num_snapshot_slots
            else "off: recurrent state without --state-snapshot-slots",
        }

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
        model: LlamaForCausalLM,
        kv_caches: KVCaches,
        *,
        graphs: DecodeGraphs | None = None,
        timeline: Timeline | None = None,
        parallel: Parallel | None = None,
        grammars: Grammars | None = None,
    ) -> ModelRunner:
        """A runner of model (the target, or the draft model for the memory profile)."""
        sampler = Sampler(self.device, self.sampling_seed)
        return ModelRunner(
            model,
            kv_caches,
            self.config.block_size,
            self.device,
            sampler,
            graphs=graphs,
            timeline=timeline,
            parallel=parallel,
            grammars=grammars,
        )

    def _allocate_pools(self) -> dict[str, float]:
        """Size the KV pool (the same blocks on every rank) and allocate it, and the draft
        model's beside it (its own layers and heads, the target's blocks); the memory figures
        for the log."""
        self.num_blocks, memory = self._size_kv_pool()
        self.state_pool = self._allocate_state_pool()
        if self.parallel is not None:  # one block space: every rank's pool holds the same blocks
            self.num_blocks = self.parallel.min_over_ranks(self.num_blocks)
        c = self.config
        self.kv_cache = allocate_kv_cache(
            self.local_config, self.num_blocks, c.block_size, self.kv_dtype, self.device
        )
        self.draft_kv_cache: torch.Tensor | None = None
        if self.draft_config is not None:
            self.draft_kv_cache = allocate_kv_cache(
                self.draft_config, self.num_blocks, c.block_size, self.kv_dtype, self.device
            )
        return memory

    def _allocate_state_pool(self) -> StatePool | None:
        """A hybrid model's state pool: one slot per sequence a step may hold (max_num_seqs)
        and --state-snapshot-slots, their bytes taken out of the KV pool's budget (unless
        --num-kv-blocks fixed the pool); None for a model without state layers."""
        c, config = self.config, self.local_config
        per_slot = state_bytes_per_slot(config, self.dtype)
        if not per_slot:
            return None
        num_slots = c.max_num_seqs + c.state_snapshot_slots
        per_block = bytes_per_block(config, c.block_size, self.kv_dtype)
        if not c.num_kv_blocks and per_block:  # 0: a stage of state layers only
            taken = -(-num_slots * per_slot // per_block)
            if taken >= self.num_blocks:
                raise RuntimeError(
                    f"the state pool ({num_slots} slots x {per_slot} bytes) leaves no KV block "
                    f"of the {self.num_blocks} the budget holds: lower --max-num-seqs"
                )
            self.num_blocks -= taken
        return StatePool(config, c.max_num_seqs, self.dtype, self.device, c.state_snapshot_slots)

    def _allocate_tiers(self) -> KVTiers | None:
        """The KV offload tiers under the pool (--kv-offload-gb, --kv-offload-dir), as many
        blocks on every rank; None without them."""
        c = self.config
        if not c.kv_offload_gb:
            return None
        per_block = bytes_per_block(self.local_config, c.block_size, self.kv_dtype)
        num_host = int(c.kv_offload_gb * GIB) // per_block
        num_disk = c.num_kv_offload_disk_bytes // per_block
        if self.parallel is not None:
            num_host = self.parallel.min_over_ranks(num_host)
            num_disk = self.parallel.min_over_ranks(num_disk)
        if num_host < 1:
            raise RuntimeError(
                f"kv_offload_gb={c.kv_offload_gb} holds no block ({per_block} bytes per block)"
            )
        return KVTiers(self.kv_cache, num_host, num_disk, c.kv_offload_dir)

    def _size_kv_pool(self) -> tuple[int, dict[str, float]]:
        """(num_blocks, memory figures for the log). On a GPU without --num-kv-blocks: from a
        profiling step at the scheduler's largest (engine.memory)."""
        c = self.config
        if self.device.type != "cuda" or c.num_kv_blocks:
            ranks = self.parallel.ranks_on_node if self.parallel is not None else 1
            return choose_num_blocks(
                c, self.local_config, self.kv_dtype, ranks, self.draft_config
            ), {}
        models: list[PooledModel] = [
            (self.local_config, partial(self._make_runner, self.model, parallel=self.parallel))
        ]
        if self.draft_model is not None and self.draft_config is not None:
            models.append((self.draft_config, partial(self._make_runner, self.draft_model)))
        using, _ = uses_graphs(c, self.device, self.model, self.parallel)
        max_graph_batch = graph_batch_sizes(c.max_num_seqs)[-1] if using else 0
        return profile_num_blocks(
            c, self.max_model_len, self.kv_dtype, self.device, models, max_graph_batch
        )

    def reset(self) -> None:
        """Forget every request (a new Step stream starts from nothing)."""
        self.mirror = Mirror(
            self.config.block_size, self.num_blocks, self.model_config.vocab_size,
            self._released_window(),
            self.state_pool.num_slots if self.state_pool is not None else 0,
            self.state_pool.num_snapshot_slots if self.state_pool is not None else 0,
        )  # fmt: skip
        self.unresolved.clear()
        self.grammars.forget_pending()
        self.transfers.reset()

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
        # Disaggregated: sends read before the copies write the pool, receives written after
        # the copies have read it (engine/kv/disaggregation.py).
        self.transfers.send(plan)
        if self.tiers is not None:
            self.tiers.execute(plan.kv_copies)
        elif plan.kv_copies:
            raise MirrorMismatch("the plan lists KV copies, but this engine has no offload tier")
        if plan.grammar_compiles and self.runner.grammars is not None:  # the sampling rank
            self.runner.grammars.start_compiles(plan.grammar_compiles)
        self.transfers.receive(plan)
        return self._launch_rows(plan)

    def _launch_rows(self, plan: StepPlanData) -> LaunchedStep:
        failed = self._place_loras(plan)
        batch = self.mirror.apply(plan, failed)
        self._restore_states(plan)
        if batch.has_lookahead:
            return self._speculate(batch)
        if self.unresolved and _needs_host_tokens(batch):
            self._resolve_oldest()
        if not batch.rows:
            return _empty_step(batch)
        step = self.runner.launch(batch, self.unresolved[-1] if self.unresolved else None)
        if plan.state_snapshot_from and self.state_pool is not None:  # after the forward
            self.state_pool.copy(plan.state_snapshot_from, plan.state_snapshot_to)
        self.mirror.commit_pending(batch)
        self.unresolved.append(step)
        return step

    def _restore_states(self, plan: StepPlanData) -> None:
        """New requests' state slots from their snapshots (prefix-cache hits), before the
        forward (the mirror checked the slots)."""
        restores = [(n.state_restore_from, n.state_slot) for n in plan.new_requests]
        restores = [pair for pair in restores if pair[0]]
        if restores and self.state_pool is not None:
            self.state_pool.copy([src for src, _ in restores], [dst for _, dst in restores])

    def _place_loras(self, plan: StepPlanData) -> dict[int, str]:
        """The plan's adapter loads into their slots; {slot: why} for those that failed."""
        if not plan.lora_loads:
            return {}
        if self.adapters is None:
            why = "this engine serves no LoRA adapters (--max-loras 0)"
            return {load.slot: why for load in plan.lora_loads}
        return self.adapters.place_all(plan.lora_loads)

    def add_lora(self, name: str, path: str) -> LoraAdapter:
        """Check the adapter at path and keep it in the host cache (AddLora); LoraError naming
        it and the reason when it cannot be served."""
        if self.adapters is None:
            raise LoraError(f"adapter {name}: this engine serves no LoRA adapters (--max-loras 0)")
        return self.adapters.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Drop an adapter from the host cache (RemoveLora)."""
        if self.adapters is not None:
            self.adapters.remove(name)

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
        """step's output, waiting for it (and for the steps launched before it). Disaggregated:
        the KV transfers arrived whole by now are written (enqueued after the steps launched)
        and reported here, with those written at launches since the last result
        (engine/kv/disaggregation.py KVTransfers.report: why it is safe with steps in flight)."""
        while step.output is None:
            self._resolve_oldest()
        self._report_compiles(step.output, idle=not step.batch.rows)
        if self.runner.grammars is not None:
            step.output.dead_end_seq_ids = self.runner.grammars.take_dead_ends()
        received, failed = self.transfers.report()
        step.output.received_transfer_ids, step.output.failed_transfer_ids = received, failed
        return step.output

    def _report_compiles(self, output: StepOutput, idle: bool) -> None:
        """Add the waiting requests' grammars compiled since the last step (and those that
        failed, as refusals) to output. idle: the step ran nothing, so its result may wait a
        little for a compile (the scheduler sends such steps only to ask)."""
        grammars = self.runner.grammars
        if grammars is None or not grammars.has_pending:
            return
        compiled, refused = grammars.take_compiled(IDLE_COMPILE_WAIT_S if idle else 0.0)
        output.compiled_seq_ids += compiled
        for seq_id, why in refused:
            output.refused_seq_ids.append(seq_id)
            output.refusal_reasons.append(why)

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
