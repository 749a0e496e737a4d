"""Start the real three-process stack (or gateway + scheduler over the fake engine) for a test,
through llmserve.stack on free loopback ports, exactly as `llmserve serve` starts it.
`Stack.close()` stops it; `assert_idle()` checks that every request ended and every KV block
is free again.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llmserve.cli import build_parser
from llmserve.client import Client, Completion
from llmserve.common.flags import from_flags
from llmserve.protos import api_pb2, scheduler_pb2
from llmserve.services import SERVICE_CONFIGS
from llmserve.stack import Stack as LaunchedStack
from llmserve.stack import local_stack
from llmserve.topology import free_port

ROOT = Path(__file__).resolve().parent.parent  # the checkout

__all__ = [
    "ROOT",
    "Stack",
    "StreamWatch",
    "child_pid",
    "children",
    "free_port",
    "serve_command",
    "start_echo_stack",
    "start_stack",
    "wait_mid_stream",
]


def serve_command(ports: list[int], *extra: str) -> list[str]:
    """`llmserve serve` on loopback with the given (gateway, scheduler, engine[, HTTP]) ports;
    without an HTTP port the HTTP API is off (its fixed default would collide). Metrics off."""
    http_port = ports[3] if len(ports) > 3 else 0
    return [
        sys.executable, "-m", "llmserve.cli", "serve", "--host", "127.0.0.1",
        "--port", str(ports[0]), "--scheduler-port", str(ports[1]),
        "--engine-port", str(ports[2]), "--http-port", str(http_port), "--metrics-port", "0",
        *extra,
    ]  # fmt: skip


def children(parent: int) -> list[tuple[int, list[bytes]]]:
    """(pid, command line) of every child process of parent."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            found.append((int(entry.name), cmdline))
    return found


def child_pid(parent: int, service: str) -> int:
    """The pid of the `llmserve <service>` child process of parent."""
    for pid, cmdline in children(parent):
        if b"llmserve.cli" in cmdline and service.encode() in cmdline:
            return pid
    raise LookupError(f"no {service} child of {parent}")


def service_configs(service: str, flags: list[str]) -> list[Any]:
    """The configs `llmserve <service> FLAGS` would run with (the echo engine's too, with
    --fake)."""
    from llmserve.engine.contract.echo import EchoEngineConfig

    args = build_parser().parse_args([service, *flags])
    configs = [from_flags(SERVICE_CONFIGS[service], args)]
    if getattr(args, "fake", False):
        configs.append(from_flags(EchoEngineConfig, args, prefix="fake-"))
    return configs


@dataclass
class Stack(LaunchedStack):
    api_key: str | None = None

    def client(self) -> Client:
        return Client(self.gateway_address, api_key=self.api_key)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        return self.scheduler_stats()

    def assert_idle(self, timeout: float = 10.0) -> scheduler_pb2.SchedulerStats:
        """Wait until no request runs or waits and every block is free; fail otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            prefill_free = s.prefill_num_free_blocks == s.prefill_num_blocks  # 0 == 0 without
            if (
                s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_blocks
                and prefill_free and s.num_transferring == 0
            ):  # fmt: skip
                return s
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"not idle after {timeout}s: running={s.num_running} waiting={s.num_waiting} "
                    f"free_blocks={s.num_free_blocks}/{s.num_blocks} prefill free blocks="
                    f"{s.prefill_num_free_blocks}/{s.prefill_num_blocks} transferring="
                    f"{s.num_transferring}"
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

    def start_engine(self) -> None:
        self.start(("engine",))

    def kill_engine(self) -> None:
        self.kill("engine")

    def close(self) -> None:
        self.stop()


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
    data_parallel_size: int = 1,
    prefill_engines: int = 0,
    decode_engines: int | None = None,
    accept_any_model: bool = True,
) -> Stack:
    """Start engine, scheduler and gateway; return once the gateway reports SERVING.

    accept_any_model: the gateway serves any OpenAI `model` name with the base model (the
    tests' own names, "m" or "x"); tests of the strict default (404 model_not_found) say False.

    fake=True runs the echo engine (engine/contract/echo.py) instead of a model; the gateway then
    needs gateway_model for its tokenizer. *_args are each service's own command-line flags. env
    adds environment variables to all three. http=True turns the gateway's HTTP API on
    (stack.http_url); api_key makes the gateway require it; data_parallel_size > 1 starts that many
    replicas (scheduler + engine) behind the gateway; prefill_engines=N that many prefill engines
    and decode_engines (default N) decode engines under the one scheduler (engine_args
    go to all)."""
    model_args = ["--model", str(model)] if model else []
    engine, *fake_config = service_configs(
        "engine", [*(["--fake"] if fake else model_args), *(engine_args or [])]
    )
    gateway_model = gateway_model or model
    gateway_flags = ["--model", str(gateway_model)] if gateway_model else []
    lenient = ["--accept-any-model"] if accept_any_model else []
    (gateway,) = service_configs("gateway", [*gateway_flags, *lenient, *(gateway_args or [])])
    if api_key:
        gateway = replace(gateway, api_key=api_key)
    (scheduler,) = service_configs("scheduler", list(scheduler_args or []))
    base = local_stack(
        engine, scheduler, gateway, http=http, data_parallel_size=data_parallel_size,
        prefill_engines=prefill_engines, decode_engines=decode_engines,
    )  # fmt: skip
    stack = Stack(
        engine=base.engine,
        scheduler=base.scheduler,
        gateway=base.gateway,
        groups=base.groups,
        prefill_engines=base.prefill_engines,
        decode_engines=base.decode_engines,
        fake=fake_config[0] if fake_config else None,
        log_dir=log_dir,
        env={"LLMSERVE_LOG_LEVEL": "INFO", **(env or {})},
        api_key=api_key,
    )
    try:
        stack.start()
        stack.wait_ready(timeout)
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
    """The echo engine (engine/contract/echo.py) over the tiny byte vocabulary of
    tests/factories.py, with its EOS, behind a real scheduler and gateway serving it as "fake-echo"
    (the engine's name;
    gateway_args may say otherwise); kwargs go to start_stack."""
    from tests.factories import EOS_TOKEN_ID, TINY_VOCAB

    gateway_args = list(kwargs.pop("gateway_args", []))
    if "--served-model-name" not in gateway_args:
        gateway_args = ["--served-model-name", "fake-echo", *gateway_args]
    return start_stack(
        fake=True,
        gateway_model=tokenizer_dir,
        gateway_args=gateway_args,
        engine_args=[
            "--fake-vocab-size", str(TINY_VOCAB), "--fake-eos-token-ids", str(EOS_TOKEN_ID),
            *engine_args,
        ],
        scheduler_args=list(scheduler),
        log_dir=log_dir,
        **kwargs,
    )  # fmt: skip
