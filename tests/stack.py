"""Start the real three-process stack (or gateway + scheduler over the fake engine) for a test.

Each service is its own `python -m llmserve.cli ...` process on free loopback ports, exactly as
`llmserve serve` starts them. `Stack.close()` stops them; `assert_idle()` checks that every request
ended and every KV block is free again. `StreamWatch` streams a request on a thread so a test can
act (kill the engine) once it knows the request is mid-stream.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from common.net import CHANNEL_OPTIONS, wait_until_serving
from llmserve.client import Client, Completion
from protos import api_pb2, scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(ports: list[int], *extra: str) -> list[str]:
    """`llmserve serve` on loopback with the given (gateway, scheduler, engine[, HTTP]) ports;
    without an HTTP port the HTTP API is off (its fixed default would collide)."""
    http_port = ports[3] if len(ports) > 3 else 0
    return [
        sys.executable, "-m", "llmserve.cli", "serve", "--host", "127.0.0.1",
        "--port", str(ports[0]), "--scheduler-port", str(ports[1]),
        "--engine-port", str(ports[2]), "--http-port", str(http_port), *extra,
    ]  # fmt: skip


@dataclass
class Stack:
    gateway_address: str
    scheduler_address: str
    engine_address: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    engine_argv: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    http_url: str | None = None  # the OpenAI API's base URL (http://host:port/v1) when on
    api_key: str | None = None

    def client(self) -> Client:
        return Client(self.gateway_address, api_key=self.api_key)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with grpc.insecure_channel(self.scheduler_address, options=CHANNEL_OPTIONS) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=5)

    def assert_idle(self, timeout: float = 10.0) -> scheduler_pb2.SchedulerStats:
        """Wait until no request runs or waits and every block is free; fail otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            if s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks:
                return s
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle after {timeout}s: running={s.num_running} waiting={s.num_waiting} "
                    f"free_blocks={s.num_free_blocks}/{s.num_blocks}"
                )
            time.sleep(0.05)

    def wait_for_stats(
        self, predicate: Callable[[scheduler_pb2.SchedulerStats], bool], timeout: float = 10.0
    ) -> scheduler_pb2.SchedulerStats:
        """The scheduler's stats once predicate holds for them; fail after timeout."""
        deadline = time.monotonic() + timeout
        while not predicate(s := self.stats()):
            if time.monotonic() > deadline:
                raise AssertionError(f"scheduler stats never matched in {timeout}s:\n{s}")
            time.sleep(0.02)
        return s

    def logs(self) -> str:
        if self.log_dir is None:
            return ""
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def start_engine(self) -> None:
        self.procs["engine"] = _spawn("engine", self.engine_argv, self.log_dir, self.env)

    def kill_engine(self) -> None:
        proc = self.procs.pop("engine")
        proc.kill()
        proc.wait()

    def close(self) -> None:
        for name in ("gateway", "scheduler", "engine"):
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class StreamWatch:
    """One request streamed on a thread of its own. The consumer sets `reached` once at_least
    tokens have arrived (or the stream ended, so nobody waits in vain); num_tokens is how many
    have arrived so far; result() joins and returns the completion, or raises the stream's error.
    """

    def __init__(self, client: Client, request: api_pb2.GenerateRequest, at_least: int):
        self.at_least = at_least
        self.reached = threading.Event()
        self.ended = False
        self._completion = Completion()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._consume, args=(client, request), daemon=True)
        self._thread.start()

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return len(self._completion.token_ids)

    def _consume(self, client: Client, request: api_pb2.GenerateRequest) -> None:
        try:
            for msg in client.stream(request, timeout=120):
                with self._lock:
                    self._completion.add(msg)
                    if len(self._completion.token_ids) >= self.at_least:
                        self.reached.set()
        except BaseException as err:  # handed to result()
            self.error = err
        finally:
            self.ended = True
            self.reached.set()

    def result(self, timeout: float = 60.0) -> Completion:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AssertionError(f"stream still open after {timeout}s ({self.num_tokens} tokens)")
        if self.error is not None:
            raise self.error
        return self._completion


def wait_mid_stream(watches: Sequence[StreamWatch], timeout: float = 30.0) -> None:
    """Return once every watched stream holds at least its at_least tokens and is still open:
    what a test kills after is then known to land mid-generation. Fail otherwise."""
    deadline = time.monotonic() + timeout
    for i, w in enumerate(watches):
        w.reached.wait(max(0.0, deadline - time.monotonic()))
        if w.num_tokens < w.at_least or w.ended:
            raise AssertionError(
                f"stream {i}: {w.num_tokens} tokens (waiting for {w.at_least}), "
                f"{'ended' if w.ended else 'still open'} after {timeout}s; error: {w.error!r}"
            )


def _spawn(
    name: str, argv: list[str], log_dir: Path | None, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMSERVE_LOG_LEVEL": "INFO", **(env or {})}
    out = open(log_dir / f"{name}.log", "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", "llmserve.cli", name, *argv],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def start_stack(
    model: Path | str | None = None,
    *,
    fake: bool = False,
    engine_args: list[str] | None = None,
    scheduler_args: list[str] | None = None,
    gateway_args: list[str] | None = None,
    gateway_model: Path | str | None = None,
    env: dict[str, str] | None = None,
    http: bool = False,
    api_key: str | None = None,
    log_dir: Path | None = None,
    timeout: float = 120.0,
) -> Stack:
    """Start engine, scheduler and gateway; return once the gateway reports SERVING.

    fake=True runs the echo engine (engine/fake.py) instead of a model; the gateway then needs
    gateway_model for its tokenizer. env adds environment variables to all three. http=True
    turns the gateway's HTTP API on (stack.http_url); api_key makes the gateway require it."""
    ports = {name: free_port() for name in ("gateway", "scheduler", "engine")}
    ports["http"] = free_port() if http else 0
    stack = Stack(
        gateway_address=f"127.0.0.1:{ports['gateway']}",
        scheduler_address=f"127.0.0.1:{ports['scheduler']}",
        engine_address=f"127.0.0.1:{ports['engine']}",
        log_dir=log_dir,
        env=dict(env or {}),
        http_url=f"http://127.0.0.1:{ports['http']}/v1" if http else None,
        api_key=api_key,
    )
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    model_args = ["--model", str(model)] if model else []
    stack.engine_argv = [
        "--host",
        "127.0.0.1",
        "--port",
        str(ports["engine"]),
        *(["--fake"] if fake else model_args),
        *(engine_args or []),
    ]
    gateway_model = gateway_model or model
    try:
        stack.start_engine()
        stack.procs["scheduler"] = _spawn(
            "scheduler",
            [
                "--host",
                "127.0.0.1",
                "--port",
                str(ports["scheduler"]),
                "--engine-address",
                stack.engine_address,
                *(scheduler_args or []),
            ],
            log_dir,
            stack.env,
        )
        stack.procs["gateway"] = _spawn(
            "gateway",
            [
                "--host",
                "127.0.0.1",
                "--port",
                str(ports["gateway"]),
                "--scheduler-address",
                stack.scheduler_address,
                *(["--model", str(gateway_model)] if gateway_model else []),
                "--http-port",
                str(ports["http"]),
                *(["--api-key", api_key] if api_key else []),
                *(gateway_args or []),
            ],
            log_dir,
            stack.env,
        )
        if not wait_until_serving(stack.gateway_address, timeout=timeout):
            dead = {n: p.poll() for n, p in stack.procs.items() if p.poll() is not None}
            raise RuntimeError(f"stack did not start (exited: {dead})\n{stack.logs()}")
    except BaseException:
        stack.close()
        raise
    return stack


def start_echo_stack(
    tokenizer_dir: Path,
    log_dir: Path | None,
    *engine_args: str,
    scheduler: tuple[str, ...] = (),
    **kwargs: Any,
) -> Stack:
    """The echo engine (engine/fake.py) over the tiny byte vocabulary of tests/factories.py, with
    its EOS, behind a real scheduler and gateway; kwargs go to start_stack."""
    from tests.factories import EOS_TOKEN_ID, TINY_VOCAB

    return start_stack(
        fake=True,
        gateway_model=tokenizer_dir,
        engine_args=[
            "--fake-vocab-size", str(TINY_VOCAB), "--fake-eos-token-id", str(EOS_TOKEN_ID),
            *engine_args,
        ],
        scheduler_args=list(scheduler),
        log_dir=log_dir,
        **kwargs,
    )  # fmt: skip
