"""The full stack (three processes, real gRPC) on a tiny random Llama: batch invariance alone vs
among concurrent requests, also with chunked prefill forced and with preemption forced."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmserve.client import Completion, make_request
from tests.stack import Stack, start_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

NUM_REQUESTS = 16
MAX_TOKENS = 24
PROMPTS = [
    f"request {i:02d} says: "
    + "the quick brown fox jumps over the lazy dog "[: 4 + 3 * i] * (1 + i % 3)
    for i in range(NUM_REQUESTS)
]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(num_heads=4, num_kv_heads=2)


def _greedy(text: str) -> object:
    return make_request(text=text, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _seeded(text: str, seed: int) -> object:
    return make_request(
        text=text, max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=seed, ignore_eos=True
    )


def _run_concurrently(stack: Stack, requests: list[object]) -> list[Completion]:
    with stack.client() as client, ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(client.generate, requests))


def _run_alone(stack: Stack, requests: list[object]) -> list[Completion]:
    with stack.client() as client:
        return [client.generate(r) for r in requests]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def default_stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(
        model_dir, engine_args=["--num-kv-blocks", "256"], log_dir=tmp_path_factory.mktemp("logs")
    )
    yield s
    s.close()


@pytest.fixture(scope="module")
def alone(default_stack: Stack) -> tuple[list[Completion], list[Completion]]:
    """Each prompt run by itself: greedy, then seeded sampling."""
    greedy = _run_alone(default_stack, [_greedy(p) for p in PROMPTS])
    seeded = _run_alone(default_stack, [_seeded(p, 1000 + i) for i, p in enumerate(PROMPTS)])
    default_stack.assert_idle()
    return greedy, seeded


def _assert_same(expected: list[Completion], actual: list[Completion]) -> None:
    for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
        assert len(e.token_ids) == MAX_TOKENS
        assert a.token_ids == e.token_ids, f"request {i} differs"
        assert a.text == e.text


def _assert_invariant(stack: Stack, alone: tuple) -> None:
    """All prompts at once, greedy then seeded: the same tokens as each alone."""
    greedy, seeded = alone
    _assert_same(greedy, _run_concurrently(stack, [_greedy(p) for p in PROMPTS]))
    _assert_same(
        seeded, _run_concurrently(stack, [_seeded(p, 1000 + i) for i, p in enumerate(PROMPTS)])
    )


def test_batch_invariance_concurrent(default_stack: Stack, alone: tuple) -> None:
    _assert_invariant(default_stack, alone)
    default_stack.assert_idle()


def test_batch_invariance_chunked_prefill(model_dir: Path, alone: tuple, tmp_path: Path) -> None:
    """A 16-token budget splits every prompt (21+ tokens) across steps, mixed with decodes."""
    assert min(len(p.encode()) for p in PROMPTS) > 16
    s = start_stack(
        model_dir,
        engine_args=["--num-kv-blocks", "256"],
        scheduler_args=["--max-num-batched-tokens", "16"],
        log_dir=tmp_path,
    )
    try:
        _assert_invariant(s, alone)
        stats = s.assert_idle()
        # Two rounds (greedy, seeded) of every prompt, at most 16 tokens a step.
        num_prompt_tokens = 2 * sum(len(p.encode()) for p in PROMPTS)
        assert stats.num_steps >= num_prompt_tokens / 16
        assert stats.num_scheduled_tokens <= 16 * stats.num_steps
    finally:
        s.close()


def test_batch_invariance_preemption(model_dir: Path, alone: tuple, tmp_path: Path) -> None:
    """12 blocks of 16 tokens cannot hold 16 requests of 45-173 tokens: requests are preempted
    and recomputed, and still produce exactly the tokens they produce alone."""
    s = start_stack(
        model_dir,
        engine_args=["--num-kv-blocks", "12"],
        scheduler_args=["--no-prefix-caching"],
        log_dir=tmp_path,
    )
    try:
        _assert_invariant(s, alone)
        stats = s.assert_idle()
        assert stats.num_preemptions > 0
        # A request that can never fit the pool is refused up front, naming the limit.
        with s.client() as client, pytest.raises(grpc.RpcError) as err:
            client.generate(make_request(text="x" * 150, max_tokens=100))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "192" in err.value.details()
    finally:
        s.close()


def test_prefix_cache_hits_keep_outputs(default_stack: Stack) -> None:
    shared = PROMPTS[-1] * 3
    with default_stack.client() as client:
        first = client.generate(_greedy(shared))  # type: ignore[arg-type]
        second = client.generate(_greedy(shared))  # type: ignore[arg-type]
    assert second.cached_prompt_tokens >= 16
    assert second.token_ids == first.token_ids
    default_stack.assert_idle()


def test_logprobs_and_chat(default_stack: Stack) -> None:
    with default_stack.client() as client:
        result = client.generate(
            make_request(
                messages=[("system", "be brief"), ("user", "hello")],
                max_tokens=8,
                temperature=0.0,
                ignore_eos=True,
                logprobs=True,
            )
        )
    assert len(result.logprobs) == len(result.token_ids) == 8
    assert all(lp <= 0.0 for lp in result.logprobs)
    assert result.prompt_tokens > len("be brief") + len("hello")
    default_stack.assert_idle()
