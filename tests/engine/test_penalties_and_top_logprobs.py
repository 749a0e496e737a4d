"""Presence / frequency penalties and top-k logprobs: the sampler's exact arithmetic, the runner's
columns, and the scheduler handing each request its own k."""

from __future__ import annotations

import math

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig
from llmserve.engine.step.runner import _full_rows
from llmserve.engine.step.sampler import Sampler, apply_penalties
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import TopLogprobColumns
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import sampling

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- penalties -----------------------------------------------------------------------------------


def test_penalties_change_exactly_the_expected_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 10)
    before = logits.clone()
    params = [
        sampling(),
        sampling(frequency_penalty=0.5, presence_penalty=1.0),
        sampling(presence_penalty=-0.5),
    ]
    outputs = [[1, 1, 1], [2, 2, 2, 5], [7, 7]]
    penalized = apply_penalties(logits, params, outputs)
    expected = before.clone()
    expected[1, 2] -= 0.5 * 3 + 1.0
    expected[1, 5] -= 0.5 * 1 + 1.0
    expected[2, 7] -= -0.5  # presence counts once, however often the token came
    assert torch.equal(penalized, expected)
    assert torch.equal(logits, before)  # the input is not modified


def test_no_penalties_cost_nothing() -> None:
    logits = torch.randn(4, 10)
    params = [sampling(temperature=0.5, top_k=3)] * 4
    # Not even the generated tokens are needed: an empty sequence is never indexed.
    assert apply_penalties(logits, params, ()) is logits


def test_penalized_row_without_outputs_is_unchanged() -> None:
    logits = torch.randn(2, 10)
    params = [sampling(frequency_penalty=2.0), sampling(presence_penalty=2.0)]
    assert torch.equal(apply_penalties(logits, params, [[], []]), logits)


def test_penalty_moves_greedy_off_a_repeated_token() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    greedy = sampling(temperature=0.0)
    assert Sampler(CPU).sample(logits, [greedy], [0]).token_ids.tolist() == [1]
    penalized = sampling(temperature=0.0, frequency_penalty=0.6, logprobs=True)
    # token 1 generated twice: 3.0 - 1.2 = 1.8 < 2.0
    out = Sampler(CPU).sample(logits, [penalized], [2], [[1, 1]])
    assert out.token_ids.tolist() == [2]
    # The logprob is the unmodified distribution's.
    assert out.logprobs is not None
    assert out.logprobs.tolist() == torch.log_softmax(logits, -1)[:, 2].tolist()


def test_penalties_follow_each_row_in_a_sampled_batch() -> None:
    """A seeded, penalized row draws the same token alone and among unpenalized batch-mates."""
    torch.manual_seed(1)
    mine = torch.randn(1, 50)
    params = sampling(temperature=1.0, seed=5, presence_penalty=1.5, frequency_penalty=0.5)
    history = [3, 3, 9, 41]
    alone = Sampler(CPU).sample(mine, [params], [4], [history]).token_ids
    batch = torch.cat([torch.randn(2, 50), mine, torch.randn(1, 50)])
    plist = [sampling(), sampling(temperature=0.0), params, sampling(seed=1)]
    tokens = Sampler(CPU, 7).sample(batch, plist, [0, 0, 4, 0], [[], [], history, []]).token_ids
    assert int(tokens[2]) == int(alone[0])


# -- top logprobs ------------------------------------------------------------------------------


def test_top_logprobs_are_topk_of_log_softmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 3
    params = [
        sampling(logprobs=True, top_logprobs=5),
        sampling(),  # asked nothing: gets the batch's k anyway, the scheduler drops it
        sampling(temperature=0.0, logprobs=True, top_logprobs=2),
        sampling(top_p=0.5, logprobs=True, top_logprobs=5, frequency_penalty=1.0),
    ]
    out = Sampler(CPU).sample(logits, params, [0, 0, 0, 3], [[], [], [], [1, 2, 3]])
    expected = torch.topk(torch.log_softmax(logits, dim=-1), 5, dim=-1)
    assert out.top_token_ids is not None and out.top_logprobs is not None
    assert torch.equal(out.top_token_ids, expected.indices)
    assert torch.equal(out.top_logprobs, expected.values)
    # Greedy: the chosen token is the first of its top-k.
    assert int(out.token_ids[2]) == int(out.top_token_ids[2, 0])


def test_no_top_logprobs_unless_asked() -> None:
    out = Sampler(CPU).sample(torch.randn(2, 20), [sampling(logprobs=True)] * 2, [0, 0])
    assert out.top_token_ids is None and out.top_logprobs is None
    assert out.logprobs is not None


def test_top_logprobs_larger_than_the_vocabulary() -> None:
    out = Sampler(CPU).sample(torch.randn(1, 3), [sampling(logprobs=True, top_logprobs=20)], [0])
    assert out.top_token_ids is not None and out.top_token_ids.shape == (1, 3)


def test_runner_spreads_top_logprobs_over_the_batch_rows() -> None:
    """Rows that sampled nothing (mid-prefill) get -1 / NaN; the rest keep their k entries."""
    rows = torch.tensor([0, 2])  # row 1 is mid-prefill
    ids = _full_rows(3, rows, torch.tensor([[5, 1], [7, 2]]), -1)
    lps = _full_rows(3, rows, torch.tensor([[-0.5, -1.5], [-0.25, -2.0]]), float("nan"))
    assert ids.shape == (3, 2) and ids.dtype == torch.int64
    assert ids.flatten().tolist() == [5, 1, -1, -1, 7, 2]
    top_logprobs = lps.flatten().tolist()
    assert top_logprobs[:2] == [-0.5, -1.5] and top_logprobs[4:] == [-0.25, -2.0]
    assert all(math.isnan(v) for v in top_logprobs[2:4])


# -- the scheduler ---------------------------------------------------------------------------------


def test_each_request_gets_its_own_k_through_the_contract() -> None:
    """The engine returns each row's own k (0 for a request that asked none); the scheduler
    hands every request exactly its rows, without reading anyone's sampling params."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), 16, 4, 64,
                          100, (99,))  # fmt: skip
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=16), EchoEngineConfig(100))
    wants = [3, 0, 1]
    for seq_id, k in enumerate(wants, start=1):
        params = sampling(logprobs=bool(k), top_logprobs=k)
        scheduler.add(Request(f"r{seq_id}", seq_id, [seq_id, 2, 3], params, 5))
    plan = scheduler.schedule()
    assert [r.seq_id for r in plan.requests] == [1, 2, 3]
    result = engine.step(plan_from_proto(plan_to_proto(plan)))
    assert result.num_top_logprobs == wants
    logprobs = result.logprobs
    assert logprobs is not None and math.isnan(logprobs[1])  # r2 asked for none
    top = TopLogprobColumns(result.num_top_logprobs, result.top_token_ids, result.top_logprobs)
    outcomes = scheduler.update(plan, result.sampled_token_ids, logprobs, top)
    echoed = [1, 2, 3]  # the echo engine's first output is the prompt's first token
    assert [(o.top_token_ids, o.top_logprobs, o.logprob) for o in outcomes] == [
        ([1, 2, 3], [0.0, -1.0, -2.0], 0.0),
        ([], [], None),
        ([3], [0.0], 0.0),
    ]
    assert [o.token_id for o in outcomes] == echoed
