"""Two replicas (scheduler + echo engine each) behind one gateway, over real gRPC: prefix
affinity, a replica killed (-9) or frozen mid-load, and its rejoining. The echo engine
(engine/contract/echo.py) and the one-token-per-byte test tokenizer make every stream's text exact.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from llmserve.client import Client, make_request
from llmserve.common.net import LIVENESS_SERVICE, check_health
from llmserve.protos import scheduler_pb2, scheduler_pb2_grpc
from tests.stack import ROOT, Stack, StreamWatch, free_port, serve_command, start_echo_stack

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

BLOCK_SIZE = 16  # the engine's default


def echo(prompt: str, n: int) -> str:
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


def start(tokenizer_dir: Path, log_dir: Path, routing: str, *engine_args: str) -> Stack:
    return start_echo_stack(
        tokenizer_dir,
        log_dir,
        "--num-kv-blocks", "64", "--max-model-len", "512", *engine_args,
        gateway_args=["--routing", routing],
        data_parallel_size=2,
    )  # fmt: skip


def wait_all_idle(
    stack: Stack, timeout: float = 10.0, replicas: list[int] | None = None
) -> list[scheduler_pb2.SchedulerStats]:
    """Every replica's stats (those listed, else all) once none runs or holds a request and all
    its blocks are free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = stack.replica_stats(replicas)
        if all(
            s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
            for s in stats
        ):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas not idle after {timeout}s:\n{stats}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def prefix_stack(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start(tokenizer_dir, tmp_path_factory.mktemp("logs"), "prefix", "--fake-step-delay-ms", "2")
    yield s
    s.close()


def test_liveness_service_answers_beside_readiness(prefix_stack: Stack) -> None:
    """The gateway and schedulers serve LIVENESS_SERVICE (what a Kubernetes liveness probe
    asks for) besides their readiness ("")."""
    for address in (prefix_stack.gateway_address, *prefix_stack.scheduler_addresses):
        assert check_health(address, service=LIVENESS_SERVICE) == "SERVING", address
        assert check_health(address) == "SERVING", address
    assert check_health(prefix_stack.gateway_address, service="no-such") == "NOT_FOUND"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica(prefix_stack: Stack) -> None:
    """Each prefix's 4 requests run on one replica, and the 3 after the first find its 4
    blocks in that replica's prefix cache."""
    prefixes = ["".join(chr(97 + (i * 7 + j) % 26) for j in range(4 * BLOCK_SIZE)) for i in (1, 2)]
    with prefix_stack.client() as client:
        for prefix in prefixes:
            before = prefix_stack.replica_stats()
            for tail in ("one", "two", "three", "four"):
                prompt = f"{prefix} {tail}"
                result = client.generate(make_request(text=prompt, max_tokens=5))
                assert result.text == echo(prompt, 5)
            after = wait_all_idle(prefix_stack)
            finished = [
                a.num_finished_requests - b.num_finished_requests
                for a, b in zip(after, before, strict=True)
            ]
            hits = [
                a.num_prefix_cache_hit_tokens - b.num_prefix_cache_hit_tokens
                for a, b in zip(after, before, strict=True)
            ]
            assert sorted(finished) == [0, 4], finished
            replica = finished.index(4)
            assert hits[replica] == 3 * 4 * BLOCK_SIZE and hits[1 - replica] == 0


def test_greedy_output_is_the_same_on_either_replica(prefix_stack: Stack) -> None:
    """Concurrent requests spread over both replicas (least loaded first), each streams the
    exact echo."""
    prompts = [f"{i} is the request that says hello" for i in range(8)]  # no shared block
    with prefix_stack.client() as client:
        before = prefix_stack.replica_stats()
        watches = [
            StreamWatch(client, make_request(text=p, max_tokens=60), at_least=1) for p in prompts
        ]
        results = [w.result(timeout=60) for w in watches]
    assert [r.text for r in results] == [echo(p, 60) for p in prompts]
    after = wait_all_idle(prefix_stack)
    finished = [
        a.num_finished_requests - b.num_finished_requests
        for a, b in zip(after, before, strict=True)
    ]
    assert sum(finished) == 8 and min(finished) >= 2, finished


def _kill_replica(stack: Stack, replica: int, sig: int = signal.SIGKILL) -> None:
    for name in stack.replica_services(replica):
        if sig == signal.SIGKILL:
            stack.kill(name)
        else:
            os.kill(stack.procs[name].pid, sig)


def _outcomes(watches: list[StreamWatch]) -> tuple[list[int], list[tuple[grpc.StatusCode, int]]]:
    """(indices completed, (code, tokens received) of each failure)."""
    done, failed = [], []
    for i, w in enumerate(watches):
        try:
            w.result(timeout=90)
            done.append(i)
        except grpc.RpcError as err:
            failed.append((err.code(), w.num_tokens))
    return done, failed


def _wait_streaming(watches: list[StreamWatch], count: int, at_least: int = 3) -> None:
    """Return once count of the watched streams hold at_least tokens; fail after 30 s."""
    deadline = time.monotonic() + 30
    while sum(w.num_tokens >= at_least for w in watches) < count:
        assert time.monotonic() < deadline, [w.num_tokens for w in watches]
        time.sleep(0.01)


def test_kill_9_of_a_replica_mid_load(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Replica 1's scheduler and engine SIGKILLed with requests running and queued on it: each
    request completes with its exact text (queued ones retried on replica 0), or, having
    streamed, fails UNAVAILABLE. Replica 0 ends with every block free; replica 1, restarted,
    rejoins and serves again."""
    stack = start(
        tokenizer_dir, tmp_path, "least-load", "--fake-step-delay-ms", "20", "--max-num-seqs", "2"
    )
    try:
        prompts = [f"load {i:02d} abcdefghij" for i in range(12)]
        with stack.client() as client:
            watches = [
                StreamWatch(client, make_request(text=p, max_tokens=80), at_least=3)
                for p in prompts
            ]
            # Both replicas have 2 running (the rest queued): wait for 4 streams mid-way.
            _wait_streaming(watches, 4)
            streamed_at_kill = [w.num_tokens for w in watches]
            _kill_replica(stack, 1)
            done, failed = _outcomes(watches)
        assert len(done) + len(failed) == 12
        assert all(code == grpc.StatusCode.UNAVAILABLE and n > 0 for code, n in failed), failed
        assert 1 <= len(failed) <= 2, failed  # replica 1 ran 2 at a time
        for i in done:
            assert watches[i].result().text == echo(prompts[i], 80)
        assert sum(n == 0 for n in streamed_at_kill) >= 6  # queued ones completed elsewhere
        wait_all_idle(stack, replicas=[0])
        # Restarted, replica 1 rejoins: concurrent requests reach it again.
        stack.start(stack.replica_services(1)[::-1])  # engine first
        _wait_rejoined(stack, 1)
        wait_all_idle(stack)
    finally:
        stack.close()


def _wait_rejoined(stack: Stack, replica: int, timeout: float = 30.0) -> None:
    """Send pairs of concurrent requests until one finishes on replica; fail after timeout."""
    deadline = time.monotonic() + timeout
    with stack.client() as client:
        while time.monotonic() < deadline:
            try:
                before = stack.replica_stats()[replica].num_finished_requests
            except grpc.RpcError:
                time.sleep(0.2)
                continue
            prompts = [f"rejoin {i}" for i in range(2)]
            watches = [
                StreamWatch(client, make_request(text=p, max_tokens=20), at_least=1)
                for p in prompts
            ]
            for w, p in zip(watches, prompts, strict=True):
                assert w.result(timeout=30).text == echo(p, 20)
            if stack.replica_stats()[replica].num_finished_requests > before:
                return
            time.sleep(0.2)
    raise AssertionError(f"replica {replica} never served again in {timeout}s")


def test_frozen_replica_is_routed_around_within_a_heartbeat(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Replica 1's scheduler and engine stopped (SIGSTOP): within a heartbeat (1 s) its queued
    requests are retried on replica 0 and its streaming ones fail UNAVAILABLE; new requests go
    to replica 0; resumed (SIGCONT), it rejoins."""
    stack = start(
        tokenizer_dir, tmp_path, "least-load", "--fake-step-delay-ms", "20", "--max-num-seqs", "2"
    )
    try:
        prompts = [f"frozen {i:02d} abcdefghij" for i in range(8)]
        with stack.client() as client:
            watches = [
                StreamWatch(client, make_request(text=p, max_tokens=80), at_least=3)
                for p in prompts
            ]
            _wait_streaming(watches, 4)
            _kill_replica(stack, 1, signal.SIGSTOP)
            stopped_at = time.monotonic()
            while not any(w.ended and w.error for w in watches):
                assert time.monotonic() < stopped_at + 30, [w.num_tokens for w in watches]
                time.sleep(0.01)
            # Failed over within a heartbeat (1 s) after the last stats (each 0.25 s), not at
            # a TCP or keepalive timeout.
            first_failure_s = time.monotonic() - stopped_at
            assert first_failure_s < 2.5, first_failure_s
            done, failed = _outcomes(watches)
            assert len(done) + len(failed) == 8
            assert all(code == grpc.StatusCode.UNAVAILABLE and n > 0 for code, n in failed)
            assert 1 <= len(failed) <= 2, failed
            for i in done:
                assert watches[i].result().text == echo(prompts[i], 80)
            result = client.generate(make_request(text="while frozen", max_tokens=5))
            assert result.text == echo("while frozen", 5)
        _kill_replica(stack, 1, signal.SIGCONT)
        _wait_rejoined(stack, 1)
        wait_all_idle(stack)
    finally:
        for name in ("scheduler-1", "engine-1"):
            if name in stack.procs:
                os.kill(stack.procs[name].pid, signal.SIGCONT)
        stack.close()


# -- `llmserve serve --data-parallel-size 2 --device cpu` on a tiny random Llama -------------------

GREEDY_PROMPTS = [f"{i} the quick brown fox " * (1 + i % 3) for i in range(6)]


def _greedy_outputs(address: str) -> list[list[int]]:
    """Each prompt twice, all at once (so with round-robin each reaches both replicas)."""
    requests = [
        make_request(text=p, max_tokens=16, temperature=0.0, ignore_eos=True)
        for p in GREEDY_PROMPTS * 2
    ]
    with Client(address) as client, ThreadPoolExecutor(len(requests)) as pool:
        return [c.token_ids for c in pool.map(client.generate, requests)]


TOKEN = "test-internal-token"  # serve takes it from LLMSERVE_INTERNAL_TOKEN


def _scheduler_stats(address: str) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10, metadata=metadata)


def test_serve_two_replicas_on_cpu_matches_one(tiny_model: Callable[..., Path]) -> None:
    """`llmserve serve --data-parallel-size 2 --device cpu`, as a user starts it: ready with
    both replicas, and greedy outputs token for token those of one replica (D = 1)."""
    model = tiny_model(num_heads=4, num_kv_heads=2)
    outputs = []
    for size in ("1", "2"):
        ports = [free_port() for _ in range(3)]
        serve = subprocess.Popen(
            serve_command(
                ports, "--model", str(model), "--num-kv-blocks", "64", "--device", "cpu",
                "--data-parallel-size", size, "--routing", "round-robin",
            ),
            cwd=ROOT,
            env={**os.environ, "LLMSERVE_INTERNAL_TOKEN": TOKEN},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip
        address = f"127.0.0.1:{ports[0]}"
        try:
            assert serve.stdout is not None
            line = serve.stdout.readline()
            assert "llmserve ready" in line, line
            assert ("2 replicas" in line) == (size == "2"), line
            with Client(address) as client:
                info = client.model_info()
            assert (info.num_replicas, info.num_replicas_ready) == (int(size), int(size))
            outputs.append(_greedy_outputs(address))
            # Round-robin: the first replica (on --scheduler-port) ran half of the 12.
            first = _scheduler_stats(f"127.0.0.1:{ports[1]}").num_finished_requests
            assert first == (12 if size == "1" else 6)
        finally:
            serve.send_signal(signal.SIGTERM)
            assert serve.wait(timeout=30) == 0
    one, two = outputs
    assert all(len(t) == 16 for t in one)
    assert one[:6] == one[6:]  # deterministic alone
    assert two == one


def test_each_replica_gets_a_gpu_per_rank_and_a_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """D = 3 replicas of a T = 2 engine group: replica i runs on GPUs 2i and 2i+1 (of
    CUDA_VISIBLE_DEVICES when set); on a CPU, each of the 6 ranks gets cores / 6 threads."""
    from llmserve.engine.config import EngineConfig
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.topology import replica_groups, split_cpu

    engine = EngineConfig(device="cuda", tensor_parallel_size=2)
    ports = list(range(40000, 40008))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    groups = replica_groups(engine, SchedulerConfig(), 3, ports)
    assert [g.env["CUDA_VISIBLE_DEVICES"] for g in groups] == ["2,3", "4,5"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2")
    groups = replica_groups(engine, SchedulerConfig(), 3, ports)
    assert [g.env["CUDA_VISIBLE_DEVICES"] for g in groups] == ["5,4", "3,2"]
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    cpu = EngineConfig(device="cpu", tensor_parallel_size=2)
    assert split_cpu(cpu, 3).num_threads == 2
    assert split_cpu(EngineConfig(device="cpu"), 3).num_threads == 4
