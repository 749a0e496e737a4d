"""The real Scheduler driving the real Engine in-process, two steps in flight: the scheduler plans
step N+1 before step N's result, and the engine launches N+1 before finishing N, taking N's tokens
for N+1's inputs from the device (its mirror holds placeholders meanwhile). Outputs must equal
one step at a time; the Mirror's checks run on every plan (through the protobuf contract)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.contract.mirror import PLACEHOLDER
from llmserve.engine.step.engine import Engine
from llmserve.engine.step.runner import ModelRunner
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import sampling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(tiny_model: Callable[..., Path], request: pytest.FixtureRequest) -> Engine:
    """On a GPU: float32 (outputs are compared across batch shapes), CUDA graphs for decode."""
    path = tiny_model(num_heads=4, num_kv_heads=2)
    config = EngineConfig(
        model=str(path),
        device=request.param,
        dtype="float32",
        num_kv_blocks=24,
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
    )
    return Engine(config)


def workload() -> list[Request]:
    """Greedy, seeded (with filters), and penalized requests; prompts of 5..40 tokens."""
    samplings = [
        sampling(temperature=0.0),
        sampling(temperature=0.9, top_p=0.9, seed=7),
        sampling(temperature=1.1, top_k=20, seed=8),
        sampling(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.3),
        sampling(temperature=0.7, min_p=0.05, seed=9, presence_penalty=0.5),
        sampling(temperature=0.0),
    ]
    return [
        Request(
            f"r{i}",
            i + 1,
            [(i * 37 + j * 11) % 200 + 3 for j in range(5 + 7 * i)],
            sampling,
            max_tokens=12 + i,
            ignore_eos=True,
        )
        for i, sampling in enumerate(samplings)
    ]


def serve(engine: Engine, depth: int, **config: Any) -> dict[int, list[int]]:
    """Run workload() through a Scheduler and engine with up to `depth` steps in flight."""
    engine.reset()
    info = engine.info
    s = Scheduler(
        SchedulerConfig(**config).adopt(info.max_num_seqs, info.max_num_batched_tokens),
        info.num_blocks,
        info.block_size,
        info.max_model_len,
        info.vocab_size,
        info.eos_token_ids,
    )
    for request in workload():
        s.add(request)
    outputs: dict[int, list[int]] = {}
    in_flight: deque[tuple[Any, Any]] = deque()
    for _ in range(2000):
        if not s.has_work and not in_flight:
            return outputs
        if len(in_flight) < depth and s.has_work:
            plan = s.schedule()
            if not plan.is_empty:
                in_flight.append((plan, engine.launch(plan_from_proto(plan_to_proto(plan)))))
                continue
        assert in_flight, "nothing in flight and nothing to plan"
        plan, step = in_flight.popleft()
        out = engine.finish(step)
        for o in s.update(plan, out.sampled_token_ids, out.logprobs):
            outputs.setdefault(o.request.seq_id, []).append(o.token_id)
        s.block_manager.check_integrity(list(s.requests.values()))
    raise AssertionError("did not finish")


def test_the_engine_reports_its_devices_step_budget(engine: Engine) -> None:
    """--max-num-batched-tokens 0 (the default) resolves to the device's budget, which the
    engine holds in its config and tells the scheduler: 512 tokens on a CPU, 2048 on a GPU."""
    expected = 512 if engine.device.type == "cpu" else 2048
    assert engine.info.max_num_batched_tokens == engine.config.max_num_batched_tokens == expected


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"max_num_batched_tokens": 24, "enable_prefix_caching": False},
    ],
    ids=["whole-prompts", "chunked", "chunked-no-cache"],
)
def test_two_steps_in_flight_give_the_same_tokens(
    engine: Engine, config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = serve(engine, 1, **config)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert all(len(t) == 12 + i for i, t in enumerate(expected.values()))

    gathered: list[int] = []
    original = ModelRunner._gather_placeholders

    def spy(self: ModelRunner, batch: Any, input_ids: Any, prev: Any) -> None:
        # count the inputs that are still placeholders when the step is launched
        gathered.append(
            sum(r.seq.pending_row >= 0 and r.seq.token_ids[-1] == PLACEHOLDER for r in batch.rows)
        )
        original(self, batch, input_ids, prev)

    monkeypatch.setattr(ModelRunner, "_gather_placeholders", spy)
    assert serve(engine, 2, **config) == expected
    assert sum(gathered) > 0, "no step took its inputs from the previous step on the device"


def test_engine_resolves_before_penalties_need_token_values(engine: Engine) -> None:
    """A penalized row counts its generated tokens on the host: launching it while its newest
    token is a placeholder first finishes the step that sampled it."""
    engine.reset()
    s = Scheduler(
        SchedulerConfig().adopt(engine.info.max_num_seqs, engine.info.max_num_batched_tokens),
        engine.info.num_blocks,
        BLOCK_SIZE,
        engine.info.max_model_len,
        engine.info.vocab_size,
        (),
    )
    s.add(workload()[3])  # frequency and presence penalties
    first = s.schedule()
    step1 = engine.launch(plan_from_proto(plan_to_proto(first)))
    assert engine.mirror.seqs[4].token_ids[-1] == PLACEHOLDER
    second = s.schedule()
    step2 = engine.launch(plan_from_proto(plan_to_proto(second)))
    assert step1.output is not None  # resolved by the second launch
    assert engine.mirror.seqs[4].token_ids[-2] == step1.output.sampled_token_ids[0]
    assert engine.finish(step2).sampled_token_ids[0] >= 0
    assert PLACEHOLDER not in engine.mirror.seqs[4].token_ids


def test_unseeded_sampling_differs_between_starts(tiny_model: Callable[..., Path]) -> None:
    """Without --seed each start draws a fresh generator seed (a restarted server does not give
    the same first unseeded reply every time); --seed fixes it."""
    path = str(tiny_model(num_heads=4, num_kv_heads=2))
    fresh = {Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=8)).sampling_seed
             for _ in range(2)}  # fmt: skip
    assert len(fresh) == 2
    fixed = Engine(EngineConfig(model=path, device="cpu", num_kv_blocks=8, seed=5))
    assert fixed.sampling_seed == 5
    assert fixed.runner.sampler.generator.initial_seed() == 5
