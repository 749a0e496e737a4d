"""A local `llmserve serve` on free loopback ports, for `bench offline` and the batching study.

    with LocalStack.start(["--max-num-seqs", "16", "--scheduling-policy", "static"]) as stack:
        ...  # stack.gateway_address, stack.scheduler_stats()

The arguments are `llmserve serve`'s own, checked by its parser before anything starts.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.net import CHANNEL_OPTIONS, wait_until_serving
from protos import scheduler_pb2, scheduler_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """`llmserve serve`'s parse of serve_args; exits with its usage message when they are bad."""
    # Imported by name: llmserve.cli imports this package to build its parser.
    cli = importlib.import_module("llmserve.cli")
    args: argparse.Namespace = cli.build_parser().parse_args(["serve", *serve_args])
    return args


def side_ports_off(defaults: argparse.Namespace) -> list[str]:
    """Flags turning off the fixed-port side servers `llmserve serve` may open by default
    (Prometheus metrics, the HTTP API), so a local stack never collides with another."""
    flags = []
    for dest, flag in (("metrics_port", "--metrics-port"), ("http_port", "--http-port")):
        if hasattr(defaults, dest):
            flags += [flag, "0"]
    return flags


@dataclass
class LocalStack:
    argv: list[str]
    proc: subprocess.Popen[bytes]
    gateway_address: str
    scheduler_address: str
    log_path: Path

    @classmethod
    def start(cls, serve_args: list[str], ready_timeout: float = 600.0) -> LocalStack:
        """Start the three processes and return once the gateway serves. On failure, raise
        RuntimeError with the end of the stack's log."""
        argv = ["serve", "--host", "127.0.0.1", "--port", str(free_port())]
        argv += ["--scheduler-port", str(free_port()), "--engine-port", str(free_port())]
        argv += side_ports_off(parse_serve_args([])) + serve_args
        args = parse_serve_args(argv[1:])  # the user's flags come last and win
        log = tempfile.NamedTemporaryFile(prefix="llmserve-bench-", suffix=".log", delete=False)  # noqa: SIM115
        env = dict(os.environ, LLMSERVE_LOG_LEVEL=os.environ.get("LLMSERVE_LOG_LEVEL", "WARNING"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", *argv],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        stack = cls(
            argv, proc, f"127.0.0.1:{args.port}", f"127.0.0.1:{args.scheduler_port}", Path(log.name)
        )
        deadline = time.monotonic() + ready_timeout
        while not wait_until_serving(stack.gateway_address, timeout=0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                stack.stop()
                why = (
                    f"exited with {proc.returncode}" if proc.returncode is not None else "timed out"
                )
                raise RuntimeError(f"the stack did not start ({why}):\n{stack.log_tail()}")
        return stack

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return ""

    def scheduler_stats(self) -> dict[str, float]:
        """The scheduler's counters (GetStats) as a flat dict."""
        from google.protobuf.json_format import MessageToDict

        with grpc.insecure_channel(self.scheduler_address, options=CHANNEL_OPTIONS) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            msg = stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=10)
        fields = MessageToDict(
            msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        return {k: float(v) for k, v in fields.items() if isinstance(v, int | float | str)}

    def stop(self) -> None:
        """SIGTERM `llmserve serve` (it stops its children) and wait; SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters accumulated between two scheduler_stats() readings (gauges taken from after)."""
    gauges = {"num_running", "num_waiting", "num_free_blocks", "num_blocks"}
    return {k: v if k in gauges else v - before.get(k, 0.0) for k, v in after.items()}
