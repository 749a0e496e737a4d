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
import pytest

from llmserve.client import Client, RequestError, make_request
from llmserve.common.net import check_health, with_default_port
from llmserve.protos import scheduler_pb2, scheduler_pb2_grpc
from tests.stack import ROOT, StreamWatch, child_pid, free_port, serve_command, wait_mid_stream

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

TOKEN = "test-internal-token"  # serve takes it from LLMSERVE_INTERNAL_TOKEN


def _scheduler_stats(address: str) -> scheduler_pb2.SchedulerStats:
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10, metadata=metadata)


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
        env={**os.environ, "LLMSERVE_INTERNAL_TOKEN": TOKEN},
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


def test_serve_refuses_a_tensor_parallel_size_the_model_does_not_split_into() -> None:
    """The built-in model has 3 KV heads: T = 2 is refused before anything starts, naming the
    sizes that work."""
    out = llmserve("serve", "--tensor-parallel-size", "2", "--device", "cpu")
    assert out.returncode == 2
    assert "tensor_parallel_size=2" in out.stderr and "use one of 1, 3" in out.stderr


def test_client_reports_unreachable_server() -> None:
    out = llmserve("generate", "hi", "--address", f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert out.returncode == 1
    assert "UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr


# -- what a new user types -----------------------------------------------------------------------


def llmserve_bytes(*args: str | bytes, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """llmserve with arguments that may be raw bytes (not UTF-8), as a shell passes them."""
    return subprocess.run(
        [sys.executable, "-m", "llmserve.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["generate", b"caf\xe9"],
            "argument prompt: not valid UTF-8: the byte 0xe9 at character 3",
        ),
        (["chat", b"\xff"], "argument message: not valid UTF-8: the byte 0xff at character 0"),
        (["chat", "hi", "--system", b"a\xffb"], "argument --system: not valid UTF-8: the byte"),
        (["generate", "hi", "--stop", b"\xc3("], "argument --stop: not valid UTF-8: the byte 0xc3"),
    ],
)
def test_arguments_that_are_not_utf8(args: list[str | bytes], message: str) -> None:
    """A shell hands over bytes; Python keeps those that are not UTF-8 as lone surrogates, which
    protobuf cannot encode: a usage error naming the argument, not a traceback."""
    out = llmserve_bytes(*args, "--address", f"127.0.0.1:{free_port()}", "--timeout", "3")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"usage: llmserve {args[0]}"), out.stderr
    assert f"error: {message}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_seed_rule_is_the_http_apis() -> None:
    """-1 is accepted (as 2**64 - 1, as over HTTP); out of range is one message, exit 2."""
    address = f"127.0.0.1:{free_port()}"
    out = llmserve("generate", "hi", "--seed", "-1", "--address", address, "--timeout", "3")
    assert out.returncode == 1 and "Traceback" not in out.stderr  # it got as far as connecting
    assert "UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr
    for seed in (str(2**64), str(-(2**63) - 1)):
        out = llmserve("generate", "hi", "--seed", seed, "--address", address)
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert out.stderr.startswith("usage: llmserve generate"), out.stderr
        assert f"error: argument --seed: seed={seed} is outside" in out.stderr
    assert make_request(text="hi", seed=-1).sampling.seed == 2**64 - 1


def test_out_of_range_int_fields_name_the_field() -> None:
    with pytest.raises(RequestError, match=r"max_tokens=4294967296 is outside the int32 range"):
        make_request(text="hi", max_tokens=2**32)
    with pytest.raises(RequestError, match=r"^stop\[1\] is not valid Unicode: lone surrogate"):
        make_request(text="hi", stop=["ok", "\ud800"])
    with pytest.raises(RequestError, match=r"^messages\[0\]\.role is not valid Unicode"):
        make_request(messages=[("\ud800", "hi")])
    with pytest.raises(RequestError, match=r"^text is not valid UTF-8: the byte 0xff"):
        make_request(text="\udcff")  # how Python keeps a byte that was not UTF-8
    out = llmserve("generate", "hi", "--max-tokens", str(2**40), "--address", "127.0.0.1:1")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "error: max_tokens=1099511627776 is outside the int32 range" in out.stderr


def test_unknown_flag_shows_the_subcommands_usage() -> None:
    out = llmserve("generate", "hi", "--max-tokenz", "3")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: llmserve generate "), out.stderr
    assert out.stderr.rstrip().endswith("error: unrecognized arguments: --max-tokenz 3")
    out = llmserve("bench", "compare", "a.json", "b.json", "--frob")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: llmserve bench compare "), out.stderr


def test_address_without_a_port_gets_the_gateways() -> None:
    assert with_default_port("localhost", 50051) == "localhost:50051"
    assert with_default_port("localhost:9", 50051) == "localhost:9"
    assert with_default_port("10.0.0.1", 50051) == "10.0.0.1:50051"
    assert with_default_port("::1", 50051) == "[::1]:50051"
    assert with_default_port("[::1]", 50051) == "[::1]:50051"
    assert with_default_port("[::1]:7", 50051) == "[::1]:7"
    assert with_default_port("unix:/tmp/gw.sock", 50051) == "unix:/tmp/gw.sock"
    assert with_default_port("dns:///example.com", 50051) == "dns:///example.com"
    with Client("localhost") as client:
        assert client.address == "localhost:50051"


def test_health_says_why_it_is_unavailable() -> None:
    port = free_port()
    out = llmserve("health", "--address", f"127.0.0.1:{port}")
    assert out.returncode == 1
    assert out.stdout.strip() == "UNAVAILABLE"
    assert out.stderr.startswith(f"error: 127.0.0.1:{port}: "), out.stderr
    assert "refused" in out.stderr.lower() or "failed to connect" in out.stderr.lower()
    out = llmserve("health", "--address", "127.0.0.1", "--wait", "0.5")
    assert out.stdout.strip() in ("UNAVAILABLE", "SERVING", "NOT_SERVING")
    assert "127.0.0.1:50051" in out.stderr or out.stdout.strip() == "SERVING"
