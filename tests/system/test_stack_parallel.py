"""Engine groups through the whole stack on the CPU (gloo): tiny random models at T = 2, P = 2
and T = 2 x P = 2 with chunked prefill, prefix caching, preemption and overlap, two "nodes" on
this machine, and kill -9 of one rank mid-generation (nothing lost). The built-in model at T = 3,
started as a user starts it: tests/system/test_e2e_smollm2.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from llmserve.client import Client, Completion, make_request
from llmserve.protos import api_pb2
from tests.stack import (
    ROOT,
    StreamWatch,
    children,
    free_port,
    start_stack,
    wait_mid_stream,
)

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

PROMPTS = [f"prompt {i}: " + "the quick brown fox " * (1 + i % 3) for i in range(8)]
MAX_TOKENS = 24


def _greedy(text: str, max_tokens: int = MAX_TOKENS) -> api_pb2.GenerateRequest:
    return make_request(text=text, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _generate_all(client: Client, requests: list[api_pb2.GenerateRequest]) -> list[Completion]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(client.generate, requests))


def rank_pids(engine_pid: int) -> list[int]:
    """The rank processes an engine started (`python -m engine.ranks`), by pid."""
    return sorted(
        pid for pid, cmdline in children(engine_pid) if b"llmserve.engine.parallel.ranks" in cmdline
    )


# ---- tiny random models ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(num_heads=4, num_kv_heads=2, num_layers=4)


@pytest.fixture(scope="module")
def expected(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Completion]:
    """One engine's greedy tokens for PROMPTS, each run alone."""
    s = start_stack(model_dir, engine_args=["--num-kv-blocks", "256"],
                    log_dir=tmp_path_factory.mktemp("one"))  # fmt: skip
    try:
        with s.client() as client:
            return [client.generate(_greedy(p)) for p in PROMPTS]
    finally:
        s.close()


GROUPS = {
    "tp2-chunked-preempting": (
        ["--tensor-parallel-size", "2", "--num-kv-blocks", "10"],
        ["--max-num-batched-tokens", "16"],
    ),
    "pp2-prefix-cached": (["--pipeline-parallel-size", "2", "--num-kv-blocks", "256"], []),
    "tp2xpp2-preempting": (
        ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--num-kv-blocks", "10"],
        ["--no-prefix-caching"],
    ),
}


@pytest.mark.parametrize("name", list(GROUPS))
def test_group_serves_what_one_engine_does(
    name: str, model_dir: Path, expected: list[Completion], tmp_path: Path
) -> None:
    """Concurrent greedy requests (overlap on) through an engine group give one engine's tokens,
    with prefill chunked / preemptions forced where named; a repeated prompt hits the prefix
    cache; every block is free afterwards."""
    engine_args, scheduler_args = GROUPS[name]
    s = start_stack(model_dir, engine_args=engine_args, scheduler_args=scheduler_args,
                    log_dir=tmp_path, timeout=180)  # fmt: skip
    try:
        with s.client() as client:
            results = _generate_all(client, [_greedy(p) for p in PROMPTS])
            again = client.generate(_greedy(PROMPTS[-1]))
        for i, (want, got) in enumerate(zip(expected, results, strict=True)):
            assert got.token_ids == want.token_ids, f"request {i} differs"
        assert again.token_ids == expected[-1].token_ids
        stats = s.assert_idle()
        if "preempting" in name:
            assert stats.num_preemptions > 0
        if "chunked" in name:
            assert stats.num_scheduled_tokens <= 16 * stats.num_steps
        if "prefix-cached" in name:
            assert again.cached_prompt_tokens >= 16
    finally:
        s.close()


def test_killed_rank_loses_no_request(
    model_dir: Path, expected: list[Completion], tmp_path: Path
) -> None:
    """kill -9 of one rank of a T = 2 group while requests stream: the group ends and restarts
    as one (serve's supervision, here the test's), and every request completes with exactly one
    engine's tokens, none repeated, none missing."""
    engine_args = ["--tensor-parallel-size", "2", "--num-kv-blocks", "256"]
    s = start_stack(model_dir, engine_args=engine_args, log_dir=tmp_path, timeout=180)
    long = 160
    try:
        with s.client() as client:
            # All three at once: concurrent greedy tokens are each one's alone (asserted for
            # this group by test_group_serves_what_one_engine_does), in a third of the steps.
            want = _generate_all(client, [_greedy(p, long) for p in PROMPTS[:3]])
            watches = [StreamWatch(client, _greedy(p, long), at_least=10) for p in PROMPTS[:3]]
            wait_mid_stream(watches, timeout=60)
            engine = s.procs["engine"]
            (rank,) = rank_pids(engine.pid)
            os.kill(rank, signal.SIGKILL)
            at_kill = [w.num_tokens for w in watches]
            assert engine.wait(timeout=30) == 1  # the group ended with its rank
            s.wait_for_stats(lambda stats: stats.num_engine_resets == 1, timeout=30)
            s.restart("engine")
            results = [w.result(timeout=120) for w in watches]
        assert all(10 <= n < long for n in at_kill), at_kill
        for w, got in zip(want, results, strict=True):
            assert got.token_ids == w.token_ids
        stats = s.assert_idle()
        assert stats.num_engine_resets == 1
    finally:
        s.close()


def test_two_nodes_on_this_machine(
    model_dir: Path, expected: list[Completion], tmp_path: Path
) -> None:
    """A T = 2 x P = 2 group over two "nodes": node 0 (ranks 0-1, the driver) inside the stack,
    node 1 (ranks 2-3) a separate `llmserve engine --nnodes 2 --node-rank 1`, meeting at
    --master-addr / --master-port."""
    port = free_port()
    group = ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
             "--master-addr", "127.0.0.1", "--master-port", str(port)]  # fmt: skip
    node1_log = (tmp_path / "node1.log").open("wb")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", "engine", "--model", str(model_dir),
         "--device", "cpu", "--num-kv-blocks", "256", "--node-rank", "1",
         "--port", str(free_port()), *group],
        cwd=ROOT, stdout=node1_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        s = start_stack(model_dir, engine_args=[*group, "--num-kv-blocks", "256"],
                        log_dir=tmp_path, timeout=180)  # fmt: skip
        try:
            with s.client() as client:
                results = _generate_all(client, [_greedy(p) for p in PROMPTS])
            for want, got in zip(expected, results, strict=True):
                assert got.token_ids == want.token_ids
            assert rank_pids(s.procs["engine"].pid) and rank_pids(node1.pid)
            s.assert_idle()
        finally:
            s.close()
        assert node1.wait(timeout=30) in (0, 1)  # node 1 ends with the group (not by abort)
        assert b"terminate called" not in (tmp_path / "node1.log").read_bytes()
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
