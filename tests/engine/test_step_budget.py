"""The step's token budget by device (--max-num-batched-tokens 0: 512 on a CPU, 2048 on a GPU)
and the CPU KV pool, which keeps its 16 x 2048 tokens whatever the shorter step (issue 42)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llmserve.engine.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EngineConfig


def test_the_budget_is_the_flag_or_the_devices() -> None:
    """0 (the default) takes the device's budget; a given one is kept on every device; a
    negative one is refused naming the field."""
    assert EngineConfig().max_num_batched_tokens == 0
    assert (CPU_STEP_TOKENS, GPU_STEP_TOKENS) == (512, 2048)
    assert EngineConfig().step_tokens("cpu") == CPU_STEP_TOKENS
    assert EngineConfig().step_tokens("cuda") == GPU_STEP_TOKENS
    given = EngineConfig(max_num_batched_tokens=4096)
    assert (given.step_tokens("cpu"), given.step_tokens("cuda")) == (4096, 4096)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=-1 must be >= 0"):
        EngineConfig(max_num_batched_tokens=-1)


def test_the_cpu_pool_keeps_16_steps_of_2048_tokens(tiny_model: Callable[..., Path]) -> None:
    """At the CPU's 512-token budget (what the engine resolves 0 to there) the KV pool is still
    sized for 16 steps of 2048 tokens, as before the shorter step (capped by memory, which a
    tiny model never meets); a larger budget given by flag still grows it. (The engine's
    resolved budget, as it reports it: tests/engine/test_engine_overlap.py.)"""
    import torch

    from llmserve.common.model_config import load_model_config
    from llmserve.engine.step.memory import choose_num_blocks

    model = str(tiny_model())
    shape = load_model_config(Path(model))
    cpu = EngineConfig(model=model, max_num_batched_tokens=CPU_STEP_TOKENS)
    blocks = choose_num_blocks(cpu, shape, torch.float32)
    assert blocks * cpu.block_size == 16 * 2048
    larger = EngineConfig(model=model, max_num_batched_tokens=4096)
    assert choose_num_blocks(larger, shape, torch.float32) == 2 * blocks
