"""The step's token budget by device (--max-num-batched-tokens 0: 512 on a CPU, 2048 on a GPU)
and the CPU KV pool, which keeps its 16 x 2048 tokens whatever the shorter step (issue 42)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from llmserve.engine.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EngineConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def test_a_cpu_engine_plans_512_token_steps_in_a_full_size_pool(
    tiny_model: Callable[..., Path],
) -> None:
    """A CPU engine left at 0 tells the scheduler 512 tokens a step and holds that in its
    config (the proposer and the profile read it); the CPU KV pool at that budget is still
    sized for 16 steps of 2048 tokens, as before the shorter step (capped by memory, which a
    tiny model never meets), and a larger budget given by flag still grows it."""
    import torch

    from llmserve.engine.step.engine import Engine
    from llmserve.engine.step.memory import choose_num_blocks
    from llmserve.scheduler.config import SchedulerConfig

    model = str(tiny_model())
    engine = Engine(EngineConfig(model=model, device="cpu", seed=0, num_kv_blocks=8))
    info = engine.info
    assert info.max_num_batched_tokens == engine.config.max_num_batched_tokens == 512
    assert SchedulerConfig().adopt(info.max_num_seqs, 512).max_num_batched_tokens == 512
    shape = engine.local_config
    blocks = choose_num_blocks(
        EngineConfig(model=model, max_num_batched_tokens=512), shape, torch.float32
    )
    assert blocks * engine.config.block_size >= 16 * 2048
    larger = EngineConfig(model=model, max_num_batched_tokens=4096)
    assert choose_num_blocks(larger, shape, torch.float32) == 2 * blocks
