"""Tensor and pipeline parallelism on the CPU (gloo): sharded layers, the split of the layers
into stages, and whole engine groups run in child processes against one engine.

The group tests run the same scripted steps (prefill chunks, decodes, a prefix-cache hit, a
preemption and its recompute) on every rank of a T x P group, as the driver's plans would
arrive, and compare the logits the driver samples from with one engine's, within 1e-4.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import check_parallel_sizes, load_model_config, valid_tp_sizes
from llmserve.common.step_plan import NewRequest, RunningColumns, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.parallel.groups import (
    ModelShard,
    Topology,
    TPGroup,
    shard_config,
    split_layers,
)
from llmserve.engine.parallel.ranks import run_group_locally
from llmserve.protos.common_pb2 import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 16
TOLERANCE = 1e-4


def test_topology_puts_the_driver_in_the_last_stage() -> None:
    ranks = [Topology(2, 3, r) for r in range(6)]
    assert [(t.stage, t.tp_rank) for t in ranks] == [(2, 0), (2, 1), (1, 0), (1, 1), (0, 0), (0, 1)]
    assert [t.is_driver for t in ranks] == [True] + [False] * 5
    assert ranks[0].stage_ranks(0) == [4, 5] and ranks[0].rank_at(1, 1) == 3


def test_layers_split_evenly_with_the_extra_ones_first() -> None:
    assert [split_layers(30, 4, s) for s in range(4)] == [
        range(0, 8), range(8, 16), range(16, 23), range(23, 30)
    ]  # fmt: skip
    assert [split_layers(2, 2, s) for s in range(2)] == [range(0, 1), range(1, 2)]


SMOLLM2 = Path(__file__).resolve().parents[3] / "configs" / "smollm2-135m"


def test_tp_sizes_must_divide_the_kv_heads() -> None:
    config = load_model_config(SMOLLM2)  # 9 heads, 3 KV heads, 30 layers
    assert valid_tp_sizes(config) == [1, 3]
    assert check_parallel_sizes(config, 3, 1) is None
    why = check_parallel_sizes(config, 2, 1)
    assert why is not None and "3 KV heads" in why and "use one of 1, 3" in why
    why = check_parallel_sizes(config, 1, 31)
    assert why is not None and "30 layers" in why


def test_shard_config_is_one_ranks_share() -> None:
    config = load_model_config(SMOLLM2)
    shard = ModelShard(TPGroup(1, 3), range(10, 20), 30)
    local = shard_config(config, shard)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (3, 1, 512)
    assert local.num_layers == 10 and local.hidden_size == config.hidden_size
    assert not shard.first and not shard.last and not shard.is_whole


def test_engine_config_checks_the_group_shape() -> None:
    assert EngineConfig(tensor_parallel_size=2, pipeline_parallel_size=2).world_size == 4
    with pytest.raises(ValueError, match="nnodes=3"):
        EngineConfig(tensor_parallel_size=2, nnodes=3)
    with pytest.raises(ValueError, match="node_rank=2"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)


# ---- whole engine groups in child processes ---------------------------------------------------


def _new(seq_id: int, tokens: list[int], table: list[int], cached: int, now: int) -> Any:
    return NewRequest(seq_id, tokens, len(tokens), GREEDY, table, cached, now)


def run_scenario(engine: Any, capture: list[torch.Tensor]) -> list[list[int]]:
    """Steps through prefill chunks, decodes, a prefix-cache hit, a preemption and its
    recompute, with blocks from a shuffled list; returns each step's sampled tokens (from the
    mirror on every rank). `capture` collects the driver's logits (other ranks: nothing)."""
    a = [(7 * i + 3) % 200 for i in range(18)]
    b = [(11 * i + 5) % 200 for i in range(37)]
    c = [*a[:16], 9, 8, 7]
    tables = {1: [5, 2], 2: [7, 1, 9], 3: [5, 12]}  # c shares a's first block
    outputs = []

    def step(step_id: int, finished: list[int], new: list[Any], run: RunningColumns) -> None:
        out = engine.step(StepPlanData(step_id, finished, new, run))
        outputs.append(list(out.sampled_token_ids))

    step(1, [], [_new(1, a, tables[1], 0, 18), _new(2, b, tables[2], 0, 20)], RunningColumns())
    step(2, [], [], RunningColumns([1, 2], [1, 17], [18, 20], [0, 0], []))
    step(
        3, [], [_new(3, c, tables[3], 16, 3)], RunningColumns([1, 2], [1, 1], [19, 37], [0, 0], [])
    )
    step(4, [], [], RunningColumns([1, 2, 3], [1, 1, 1], [20, 38, 19], [0, 0, 0], []))
    # Preempt 2: dropped, then back as a new request with all its tokens, recomputed.
    b_now = list(engine.mirror.seqs[2].token_ids)
    step(5, [2], [], RunningColumns([1, 3], [1, 1], [21, 20], [0, 0], []))
    step(
        6, [], [_new(4, b_now, [11, 4, 6], 0, len(b_now))], RunningColumns([1], [1], [22], [0], [])
    )
    step(7, [], [], RunningColumns([1, 3, 4], [1, 1, 1], [23, 21, len(b_now)], [0, 0, 0], []))
    return outputs


def _engine_config(model: Path, tp: int, pp: int, **kwargs: Any) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        device="cpu",
        num_kv_blocks=16,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=64,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_threads=1,
        seed=0,
        **kwargs,
    )


def _capturing(engine: Any) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    original = engine.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        captured.append(logits.clone())
        return logits

    engine.model.compute_logits = capture
    return captured


def _scenario_on_rank(engine: Any, parallel: Any) -> tuple[list[list[int]], list[Any], int]:
    """On each rank: (its outputs, the driver's logits, its num_blocks)."""
    captured = _capturing(engine)
    outputs = run_scenario(engine, captured)
    logits = [t.tolist() for t in captured] if parallel.topology.is_driver else []
    return outputs, logits, engine.num_blocks


@pytest.fixture(scope="module")
def reference(tiny_model: Any) -> tuple[Path, list[list[int]], list[torch.Tensor]]:
    """One engine's outputs and logits over the scenario (the tiny model: 4 heads, 4 KV heads
    so T = 2 and 4 both divide them; 4 layers)."""
    from llmserve.engine.step.engine import Engine

    model = tiny_model(num_heads=4, num_kv_heads=4, num_layers=4)
    engine = Engine(_engine_config(model, 1, 1))
    captured = _capturing(engine)
    return model, run_scenario(engine, captured), captured


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (4, 1), (1, 2), (2, 2)])
def test_group_matches_one_engine(reference: Any, tp: int, pp: int) -> None:
    model, want_outputs, want_logits = reference
    got = run_group_locally(_engine_config(model, tp, pp), _scenario_on_rank, timeout=180)
    outputs, logits, _ = got[0]
    assert outputs == want_outputs
    for rank, (rank_outputs, _, num_blocks) in enumerate(got):
        assert rank_outputs == want_outputs, f"rank {rank}'s mirror saw other tokens"
        assert num_blocks == 16
    assert len(logits) == len(want_logits)
    for i, (ours, want) in enumerate(zip(logits, want_logits, strict=True)):
        err = (torch.tensor(ours) - want).abs().max().item()
        assert err < TOLERANCE, f"step {i + 1}: logits differ by {err:.2e} at T={tp} x P={pp}"


@pytest.mark.gpu
def test_group_of_one_on_cuda_matches_one_engine(tiny_model: Any) -> None:
    """What one GPU allows: a group of one rank over NCCL (the driver's token broadcast and the
    parallel runner path on CUDA) against a plain engine, bf16."""
    from llmserve.engine.step.engine import Engine

    model = tiny_model(num_heads=4, num_kv_heads=4, num_layers=4)
    config = replace(_engine_config(model, 1, 1), device="cuda", num_threads=0)
    engine = Engine(config)
    want_logits = _capturing(engine)
    want = run_scenario(engine, want_logits)
    del engine
    got = run_group_locally(config, _scenario_on_rank, timeout=300)
    outputs, logits, _ = got[0]
    assert outputs == want
    for ours, theirs in zip(logits, want_logits, strict=True):
        assert (torch.tensor(ours) - theirs.float().cpu()).abs().max().item() < 2e-2


class _ScriptedControl:
    """Stands in for a Parallel's control channel: hands out scripted messages."""

    def __init__(self, messages: list[tuple[str, bytes]]):
        self.messages = list(messages)

    def receive_control(self) -> tuple[str, bytes]:
        return self.messages.pop(0)


def test_rank_skips_plans_after_a_refused_one_until_reset(tiny_model: Any) -> None:
    """The driver ends a Step stream at a plan the mirror refuses; a rank must not run the plans
    forwarded after it (their collectives would wait forever for the driver), until the reset
    that opens the next stream."""
    from llmserve.engine.parallel.ranks import run_rank
    from llmserve.engine.step.engine import Engine
    from llmserve.protos import engine_pb2

    engine = Engine(_engine_config(tiny_model(num_heads=4, num_kv_heads=4, num_layers=4), 1, 1))
    launched: list[int] = []
    original = engine.launch

    def launch(plan: StepPlanData) -> Any:
        launched.append(plan.step_id)
        return original(plan)

    engine.launch = launch  # type: ignore[method-assign]
    fresh = engine_pb2.NewRequest(
        seq_id=1, token_ids=[1, 2, 3], num_prompt_tokens=3, sampling=GREEDY, block_table=[4],
        num_computed_tokens=0, num_scheduled_tokens=3,
    )  # fmt: skip

    def plan(step_id: int, seq_id: int = 0, computed: int = 3) -> bytes:
        msg = engine_pb2.StepPlan(step_id=step_id)
        if seq_id:
            msg.running.seq_ids.append(seq_id)
            msg.running.num_scheduled_tokens.append(1)
            msg.running.num_computed_tokens.append(computed)
            msg.running.num_new_blocks.append(0)
        else:
            msg.new_requests.append(fresh)
        return msg.SerializeToString()

    script = [
        ("plan", plan(1)),
        ("plan", plan(2, seq_id=99)),  # not in the mirror: refused
        ("plan", plan(3, seq_id=1)),  # forwarded after it: skipped
        ("reset", b""),
        ("plan", plan(1)),
        ("stop", b""),
    ]
    run_rank(engine, _ScriptedControl(script))  # type: ignore[arg-type]
    assert launched == [1, 2, 1]
    assert list(engine.mirror.seqs) == [1]
