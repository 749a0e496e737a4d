"""`llmserve serve` starts the three processes and stops them on SIGTERM; the client commands
stream, print JSON, and exit non-zero with the server's message when refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from common.net import check_health
from llmserve.client import Client, make_request
from protos import scheduler_pb2, scheduler_pb2_grpc
from tests.stack import ROOT, StreamWatch, child_pid, free_port, serve_command, wait_mid_stream


def _scheduler_stats(address: str) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)


def llmserve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_serve_generate_chat_and_stop(tiny_model: Callable[..., Path]) -> None:
    model = tiny_model(num_heads=4, num_kv_heads=2)
    ports = [free_port() for _ in range(3)]
    serve = subprocess.Popen(
        serve_command(ports, "--model", str(model), "--num-kv-blocks", "64"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    address = f"127.0.0.1:{ports[0]}"
    try:
        assert serve.stdout is not None
        line = serve.stdout.readline()
        assert "llmserve ready" in line, line

        out = llmserve(
            "generate",
            "hello there",
            "--address",
            address,
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert len(result["token_ids"]) == 5 and result["finish_reason"] == "length"
        assert isinstance(result["text"], str)

        out = llmserve(
            "chat", "hi", "--address", address, "--max-tokens", "3", "--seed", "7", "--json"
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["usage"]["completion_tokens"] <= 3

        out = llmserve("generate", "hi", "--address", address, "--temperature", "-1")
        assert out.returncode == 1
        assert "INVALID_ARGUMENT" in out.stderr and "temperature=-1.0" in out.stderr

        assert llmserve("health", "--address", address).stdout.strip() == "SERVING"

        # Kill the engine mid-request: serve restarts it, and the request still completes with
        # the tokens an uninterrupted run gives.
        request = make_request(text="survive", max_tokens=120, temperature=0.0, ignore_eos=True)
        with Client(address) as client:
            expected = client.generate(request)
            engine_pid = child_pid(serve.pid, "engine")
            watch = StreamWatch(client, request, at_least=20)
            wait_mid_stream([watch])
            os.kill(engine_pid, signal.SIGKILL)
            at_kill = watch.num_tokens
            result = watch.result(timeout=120)
        assert 20 <= at_kill < 120, at_kill
        assert result.token_ids == expected.token_ids and result.finish_reason == "length"
        assert child_pid(serve.pid, "engine") != engine_pid  # a new engine served the rest
        stats = _scheduler_stats(f"127.0.0.1:{ports[1]}")
        assert (stats.num_running, stats.num_waiting, stats.num_engine_resets) == (0, 0, 1)
        assert stats.num_free_blocks == stats.num_blocks
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
    # Every child is gone (serve waits for them): nothing answers on any of the three ports.
    for port in ports:
        assert check_health(f"127.0.0.1:{port}", timeout=1) == "UNAVAILABLE"


def test_serve_refuses_a_missing_model(tmp_path: Path) -> None:
    out = llmserve("serve", "--model", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "expected an HF directory" in out.stderr


def test_client_reports_unreachable_server() -> None:
    out = llmserve("generate", "hi", "--address", f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr
