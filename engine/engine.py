"""The engine proper: loads the model and the KV pool once, then executes plans one at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_cache, bytes_per_block, layer_views
from engine.mirror import Mirror, StepPlanData
from engine.model import build_model
from engine.runner import ModelRunner, StepOutput
from engine.sampler import Sampler
from engine.weights import load_weights
from llmserve.log import get_logger
from llmserve.model_config import ModelConfig, load_model_config, resolve_model_path

log = get_logger("engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int
    device: str
    dtype: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[name]


def choose_num_blocks(
    config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    per_block = bytes_per_block(model_config, config.block_size, dtype)
    if config.num_kv_blocks:
        return config.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Keep (1 - utilization) of the card, and 2 GiB for activations, out of the pool.
        budget = free - (1 - config.gpu_memory_utilization) * total - (2 << 30)
    else:
        budget = config.kv_cache_gb * (1 << 30)
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise RuntimeError(f"no memory left for the KV pool ({per_block} bytes per block)")
    return num_blocks


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        t0 = time.perf_counter()
        path = resolve_model_path(config.model)
        self.model_config = load_model_config(path)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        max_len = self.model_config.max_position_embeddings
        if config.max_model_len:
            max_len = min(max_len, config.max_model_len)
        self.max_model_len = max_len
        weights = load_weights(path, self.model_config)
        self.model = build_model(self.model_config, weights, max_len, self.dtype, self.device)
        del weights
        self.num_blocks = choose_num_blocks(config, self.model_config, self.dtype, self.device)
        self.kv_cache = allocate_kv_cache(
            self.model_config, self.num_blocks, config.block_size, self.dtype, self.device
        )
        self.runner = ModelRunner(
            self.model,
            layer_views(self.kv_cache),
            config.block_size,
            self.device,
            Sampler(self.device, config.seed),
        )
        self.mirror = Mirror(config.block_size, self.num_blocks)
        self.info = EngineInfo(
            model=self.model_config.name,
            vocab_size=self.model_config.vocab_size,
            max_model_len=max_len,
            eos_token_ids=self.model_config.eos_token_ids,
            block_size=config.block_size,
            num_blocks=self.num_blocks,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
        )
        log.info(
            "engine loaded",
            model=str(path),
            device=str(self.device),
            dtype=self.info.dtype,
            num_blocks=self.num_blocks,
            kv_tokens=self.num_blocks * config.block_size,
            max_model_len=max_len,
            load_s=round(time.perf_counter() - t0, 2),
        )

    def reset(self) -> None:
        """Forget every request (a new Step stream starts from nothing)."""
        self.mirror = Mirror(self.config.block_size, self.num_blocks)

    def step(self, plan: StepPlanData) -> StepOutput:
        """Apply plan to the mirror, run it, commit the sampled tokens.

        Raises MirrorMismatch (mirror possibly half-updated) when the plan disagrees."""
        batch = self.mirror.apply(plan)
        if not batch.rows:
            return StepOutput([], None, 0.0, 0.0)
        output = self.runner.execute(batch)
        self.mirror.commit(batch, output.sampled_token_ids)
        return output
