"""How the stack starts, stops, loses a process and comes back:

- `llmserve serve` refuses ports already taken, and trusts only the gateway it started itself;
  quickstart.sh fails when serve fails;
- the children die with serve, however serve ends (SIGKILL, SIGHUP);
- readiness follows the engine's heartbeat (a frozen engine turns /ready to 503, and back);
- serve restarts a crashed scheduler or gateway; the open streams end with UNAVAILABLE;
- a request the server itself ends (shutdown) is an UNAVAILABLE error, never a finish reason;
- Ctrl-C in `llmserve chat` stops the answer and keeps the conversation.

Tests that kill or stop processes wait on what they can observe (tokens streamed, a status
seen, a process gone), never on fixed sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from llmserve.client import Client, make_request
from llmserve.common.net import check_health
from llmserve.stack import StackError, local_stack
from llmserve.topology import free_ports
from tests.stack import (
    ROOT,
    Stack,
    StreamWatch,
    child_pid,
    serve_command,
    start_echo_stack,
    wait_mid_stream,
)

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until predicate() held (polled every 50 ms); fail after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - start


def echo(prompt: str, n: int) -> str:
    data = prompt.encode()
    return bytes(data[i % len(data)] for i in range(n)).decode()


def is_gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it runs no code, holds no port)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


class Serve:
    """`llmserve serve` in a subprocess, on free ports, its stderr in a file."""

    def __init__(self, log_dir: Path, *extra: str, http: bool = False):
        self.ports = free_ports(4 if http else 3)
        self.stderr_path = log_dir / "serve.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                serve_command(self.ports, *extra),
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert "llmserve ready" in line, f"{line!r}\n{self.stderr()}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports[0]}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports[3]}/v1"

    def child(self, service: str) -> int:
        return child_pid(self.proc.pid, service)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)


@pytest.fixture
def tiny(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(num_heads=4, num_kv_heads=2)


# -- 1. ports taken, another server on them --------------------------------------------------------


@pytest.mark.parametrize("taken", [0, 1], ids=["gateway", "scheduler"])
def test_serve_on_a_taken_port_exits_2_naming_it(taken: int) -> None:
    ports = free_ports(3)
    with socket.socket() as other:
        other.bind(("127.0.0.1", ports[taken]))
        other.listen()
        out = subprocess.run(
            serve_command(ports), cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    what = ("gateway", "scheduler")[taken]
    assert out.returncode == 2, out.stderr
    assert f"{what} port {ports[taken]} is already in use" in out.stderr
    assert "Traceback" not in out.stderr and "ready" not in out.stdout


def test_wait_ready_is_not_fooled_by_another_server() -> None:
    """Another server answering SERVING on the gateway's port is not our gateway."""
    other = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, other)
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        stack = local_stack()
        stack.gateway = replace(stack.gateway, port=port)
        with pytest.raises(StackError, match=f"127.0.0.1:{port} .*another server"):
            stack.wait_ready(timeout=10)
    finally:
        other.stop(grace=None)


FAKE_LLMSERVE = """#!/usr/bin/env bash
# A stand-in for llmserve: `serve` fails (FAKE_SERVE=fail) or prints ready and waits for
# SIGTERM; `health` claims SERVING (as another server on the port would); `chat` answers.
echo "$1" >>"$(dirname "$0")/calls"
case "$1" in
  serve)
    if [ "${FAKE_SERVE:-}" = fail ]; then
      echo "error: gateway port 50051 is already in use on 127.0.0.1" >&2
      exit 2
    fi
    trap 'echo stopped >>"$(dirname "$0")/calls"; exit 0' TERM
    echo "llmserve ready: gateway at 127.0.0.1:50051 (Ctrl-C stops it)"
    while :; do sleep 0.05; done ;;
  health) echo SERVING ;;
  chat) echo Paris ;;
esac
"""


def _fake_checkout(root: Path) -> Path:
    """quickstart.sh in a tree of its own, with a no-op setup.sh and a fake llmserve."""
    (root / "scripts").mkdir()
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / "quickstart.sh").write_text((ROOT / "quickstart.sh").read_text())
    (root / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\n")
    (root / ".venv" / "bin" / "activate").write_text(f'PATH="{root}/.venv/bin:$PATH"\n')
    (root / ".venv" / "bin" / "llmserve").write_text(FAKE_LLMSERVE)
    for path in ("quickstart.sh", "scripts/setup.sh", ".venv/bin/llmserve"):
        (root / path).chmod((root / path).stat().st_mode | stat.S_IXUSR)
    return root / ".venv" / "bin" / "calls"


@pytest.mark.parametrize("serve", ["fail", "ok"])
def test_quickstart_once_exits_with_serve(tmp_path: Path, serve: str) -> None:
    calls = _fake_checkout(tmp_path)
    out = subprocess.run(
        ["bash", str(tmp_path / "quickstart.sh"), "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FAKE_SERVE": serve},
    )
    if serve == "fail":
        assert out.returncode == 2, out.stdout + out.stderr
        assert "already in use" in out.stderr
        assert "chat" not in calls.read_text()  # another server's SERVING fooled nobody
    else:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "Paris" in out.stdout
        assert calls.read_text().split() == ["serve", "chat", "stopped"]


# -- 2. the children die with serve ----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_children_die_with_serve(tiny: Path, tmp_path: Path, sig: signal.Signals) -> None:
    serve = Serve(tmp_path, "--model", str(tiny), "--num-kv-blocks", "64")
    try:
        children = [serve.child(name) for name in ("engine", "scheduler", "gateway")]
        os.kill(serve.proc.pid, sig)
        code = serve.proc.wait(timeout=30)
        took = wait_for(lambda: all(map(is_gone, children)), 10, "every child gone")
        print(f"{sig.name}: serve exited {code}; its children were gone {took:.2f}s later")
    finally:
        serve.stop()
        for pid in children:
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)
    assert code == (0 if sig == signal.SIGHUP else -signal.SIGKILL)
    for port in serve.ports:
        assert check_health(f"127.0.0.1:{port}", timeout=1) == "UNAVAILABLE"


# -- 3. readiness follows the engine's heartbeat ---------------------------------------------------


def _ready(stack: Stack) -> int:
    assert stack.http_url is not None
    return httpx2.get(stack.http_url.removesuffix("/v1") + "/ready").status_code


def test_frozen_engine_turns_readiness_off_then_on(tokenizer_dir: Path, tmp_path: Path) -> None:
    stack = start_echo_stack(tokenizer_dir, tmp_path, "--fake-step-delay-ms", "20", http=True)
    engine = stack.procs["engine"].pid
    try:
        prompt = "frozen but not lost "
        with stack.client() as client:
            watch = StreamWatch(client, make_request(text=prompt, max_tokens=200), at_least=10)
            wait_mid_stream([watch])
            os.kill(engine, signal.SIGSTOP)
            try:
                took = wait_for(
                    lambda: check_health(stack.gateway_address) == "NOT_SERVING",
                    15,
                    "the gateway NOT_SERVING after SIGSTOP of the engine",
                )
                assert _ready(stack) == 503
                print(f"readiness dropped {took:.2f}s after SIGSTOP")
            finally:
                os.kill(engine, signal.SIGCONT)
            back = wait_for(lambda: _ready(stack) == 200, 15, "/ready 200 after SIGCONT")
            print(f"readiness back {back:.2f}s after SIGCONT")
            assert check_health(stack.gateway_address) == "SERVING"
            result = watch.result(timeout=60)
        assert result.text == echo(prompt, 200) and result.finish_reason == "length"
        stack.assert_idle()
    finally:
        stack.close()


# -- 4. a crashed scheduler or gateway is restarted ------------------------------------------------


class HttpStream:
    """One streamed HTTP completion read on a thread: `started` once the first chunk is in;
    `error` the exception the openai SDK raised, if any."""

    def __init__(self, base_url: str, **body: Any):
        self.started = threading.Event()
        self.text = ""
        self.error: Exception | None = None
        sdk = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
        self.thread = threading.Thread(target=self._read, args=(sdk, body), daemon=True)
        self.thread.start()

    def _read(self, sdk: openai.OpenAI, body: dict[str, Any]) -> None:
        try:
            extra = {"ignore_eos": body.pop("ignore_eos")} if "ignore_eos" in body else None
            stream = sdk.completions.create(model="any", stream=True, extra_body=extra, **body)
            for chunk in stream:
                self.text += chunk.choices[0].text if chunk.choices else ""
                self.started.set()
        except Exception as err:
            self.error = err
        finally:
            self.started.set()

    def join(self, timeout: float = 30) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "HTTP stream still open"


def _long_request() -> dict[str, Any]:
    return {"max_tokens": 900, "temperature": 0.0, "ignore_eos": True}


def test_crashed_scheduler_and_gateway_are_restarted(tiny: Path, tmp_path: Path) -> None:
    serve = Serve(
        tmp_path, "--model", str(tiny), "--num-kv-blocks", "128", "--accept-any-model", http=True
    )
    try:
        with Client(serve.address) as client:
            expected = client.generate(make_request(text="after", max_tokens=8, temperature=0.0))
            # Kill the scheduler while a gRPC and an HTTP stream are open.
            request = make_request(text="keep going", **_long_request())
            watch = StreamWatch(client, request, at_least=5)
            wait_mid_stream([watch])
            http = HttpStream(serve.http_url, prompt="keep going", **_long_request())
            assert http.started.wait(30) and http.error is None, http.error
            os.kill(serve.child("scheduler"), signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                watch.result(timeout=30)
            http.join()
        code, details = err.value.code(), err.value.details()
        assert code == grpc.StatusCode.UNAVAILABLE and "lost the scheduler" in details, details
        assert isinstance(http.error, openai.APIError), repr(http.error)
        assert "lost the scheduler" in http.error.message

        # serve started a new scheduler; the gateway found it by itself.
        took = wait_until_answering(serve, expected.token_ids) - killed
        print(f"answering again {took:.2f}s after the scheduler's SIGKILL")
        assert serve.proc.poll() is None
        assert "scheduler exited with -9; restarting it" in serve.stderr()

        gateway = serve.child("gateway")
        os.kill(gateway, signal.SIGKILL)
        killed = time.monotonic()
        took = wait_until_answering(serve, expected.token_ids) - killed
        print(f"answering again {took:.2f}s after the gateway's SIGKILL")
        assert serve.child("gateway") != gateway
        assert "gateway exited with -9; restarting it" in serve.stderr()
        assert serve.proc.poll() is None
    finally:
        serve.stop()
    assert serve.proc.returncode == 0


def test_serve_gives_up_after_3_restarts_in_10_minutes() -> None:
    """The restart budget is shared by the three services: the 4th crash ends serve (exit 1)."""
    from llmserve.cli import _supervise

    class Crashing:
        def __init__(self) -> None:
            self.restarted: list[str] = []

        def dead(self) -> list[tuple[str, int]]:
            return [("scheduler", -9)] if len(self.restarted) < 2 else [("gateway", -9)]

        def restart(self, name: str) -> None:
            self.restarted.append(name)

    stack = Crashing()
    assert _supervise(stack, {"signal": 0}) == 1
    assert stack.restarted == ["scheduler", "scheduler", "gateway"]


def wait_until_answering(serve: Serve, expected: list[int], timeout: float = 60) -> float:
    """When (time.monotonic()) the gateway answered a request with the expected tokens again
    (retried while it is UNAVAILABLE); the HTTP API must answer then too."""
    start = time.monotonic()
    request = make_request(text="after", max_tokens=8, temperature=0.0)
    with Client(serve.address) as client:
        while True:
            try:
                again = client.generate(request, timeout=10)
                break
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
                assert time.monotonic() - start < timeout, f"still {err.details()}"
                time.sleep(0.1)
    answered = time.monotonic()
    assert again.token_ids == expected
    sdk = openai.OpenAI(base_url=serve.http_url, api_key="none", max_retries=0)
    http = sdk.completions.create(model="any", prompt="after", max_tokens=8, temperature=0.0)
    assert http.choices[0].text
    wait_for(lambda: check_health(serve.address) == "SERVING", 10, "the gateway SERVING")
    return answered


# -- 5. a request the server ends is an error ------------------------------------------------------


class CliStream:
    """`llmserve generate` in a subprocess; `started` once it has printed its first text."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", "generate", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.read(1)  # blocks until the first text is printed


def test_shutdown_mid_request_is_unavailable(tokenizer_dir: Path, tmp_path: Path) -> None:
    stack = start_echo_stack(tokenizer_dir, tmp_path, "--fake-step-delay-ms", "20", http=True)
    try:
        long = make_request(text="abcdefgh", max_tokens=400)
        with stack.client() as client:
            watch = StreamWatch(client, long, at_least=5)
            assert stack.http_url is not None
            http = HttpStream(stack.http_url, prompt="abcdefgh", max_tokens=400)
            cli = CliStream("abcdefgh", "--address", stack.gateway_address, "--max-tokens", "400")
            wait_mid_stream([watch])
            assert http.started.wait(30) and cli.first == "a"
            stack.stop()  # SIGTERM to all three, as Ctrl-C on `llmserve serve`
            with pytest.raises(grpc.RpcError) as err:
                watch.result(timeout=30)
            http.join()
            _, cli_err = cli.proc.communicate(timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (err.value.details() or "")
        assert isinstance(http.error, openai.APIError), repr(http.error)
        assert "shutting down" in http.error.message
        assert cli.proc.returncode == 1
        assert "error: UNAVAILABLE:" in cli_err and "shutting down" in cli_err
        assert "Traceback" not in cli_err
    finally:
        stack.close()
    finished = [
        json.loads(line)
        for line in (tmp_path / "gateway.log").read_text().splitlines()
        if '"request finished"' in line
    ]
    assert len(finished) == 3
    assert {(r["finish_reason"], r["status_code"]) for r in finished} == {("error", "UNAVAILABLE")}


# -- 6. Ctrl-C in `llmserve chat` ------------------------------------------------------------------


class Output:
    """A pipe read on a thread into one growing string."""

    def __init__(self, pipe: IO[str]):
        self.text = ""
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(pipe,), daemon=True).start()

    def _read(self, pipe: IO[str]) -> None:
        while char := pipe.read(1):
            with self._changed:
                self.text += char
                self._changed.notify_all()

    def wait_for(self, predicate: Callable[[str], bool], timeout: float = 30) -> str:
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.text), timeout):
                raise AssertionError(f"output never matched in {timeout}s: {self.text!r}")
            return self.text


@pytest.fixture
def chat_stack(tokenizer_dir: Path, tmp_path: Path) -> Iterator[Stack]:
    stack = start_echo_stack(tokenizer_dir, tmp_path, "--fake-step-delay-ms", "10")
    yield stack
    stack.close()


def _chat(stack: Stack) -> tuple[subprocess.Popen[str], Output, Output]:
    address = stack.gateway_address
    command = ["chat", "--address", address, "--max-tokens", "300", "--ignore-eos"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", *command],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C as at a terminal: a pytest started in the background by a non-interactive shell
        # (`./test.sh &`) ignores SIGINT, and a child inherits that, so the chat would rightly
        # ignore Ctrl-C at its prompt and the test would wait for it to leave
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdin and proc.stdout and proc.stderr
    return proc, Output(proc.stdout), Output(proc.stderr)


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_conversation(chat_stack: Stack) -> None:
    proc, out, err = _chat(chat_stack)
    assert proc.stdin is not None
    try:
        proc.stdin.write("hello\n")
        proc.stdin.flush()
        out.wait_for(lambda text: len(text) > len("> ") + 20)
        proc.send_signal(signal.SIGINT)
        text = out.wait_for(lambda text: text.count("> ") == 2)
        partial = text[len("> ") : -len("\n> ")]
        assert 20 <= len(partial) < 300 and proc.poll() is None
        assert "Traceback" not in err.wait_for(lambda text: "(stopped" in text)
        chat_stack.assert_idle()  # the stream was cancelled: its blocks are free

        # The next turn's prompt holds the partial answer: the echo engine repeats it.
        proc.stdin.write("again\n")
        proc.stdin.flush()
        text = out.wait_for(lambda text: text.count("> ") == 3)
        answer = text[len("> ") + len(partial) + len("\n> ") : -len("\n> ")]
        assert answer.startswith(f"user\nhello\nassistant\n{partial}\nuser\nagain\nassistant\n")

        # Ctrl-C at the prompt leaves quietly.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in err.text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
