"""Start the real three-process stack (or gateway + scheduler over the fake engine) for a test,
through llmserve.launcher on free loopback ports, exactly as `llmserve serve` starts it.
`Stack.close()` stops it; `assert_idle()` checks that every request ended and every KV block
is free again.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.flags import from_flags
from llmserve.cli import SERVICE_CONFIGS, build_parser
from llmserve.client import Client
from llmserve.launcher import ROOT, free_port, local_stack
from llmserve.launcher import Stack as LaunchedStack
from protos import scheduler_pb2

__all__ = ["ROOT", "Stack", "free_port", "serve_command", "start_echo_stack", "start_stack"]


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


def service_configs(service: str, flags: list[str]) -> list[Any]:
    """The configs `llmserve <service> FLAGS` would run with (the echo engine's too, with
    --fake)."""
    from engine.fake import FakeEngineConfig

    args = build_parser().parse_args([service, *flags])
    configs = [from_flags(SERVICE_CONFIGS[service], args)]
    if getattr(args, "fake", False):
        configs.append(from_flags(FakeEngineConfig, args, prefix="fake-"))
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
        import time

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

    def start_engine(self) -> None:
        self.start(("engine",))

    def kill_engine(self) -> None:
        self.kill("engine")

    def close(self) -> None:
        self.stop()


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
    gateway_model for its tokenizer. *_args are each service's own command-line flags. env adds
    environment variables to all three. http=True turns the gateway's HTTP API on
    (stack.http_url); api_key makes the gateway require it."""
    model_args = ["--model", str(model)] if model else []
    engine, *fake_config = service_configs(
        "engine", [*(["--fake"] if fake else model_args), *(engine_args or [])]
    )
    gateway_model = gateway_model or model
    gateway_flags = ["--model", str(gateway_model)] if gateway_model else []
    (gateway,) = service_configs("gateway", [*gateway_flags, *(gateway_args or [])])
    if api_key:
        gateway = replace(gateway, api_key=api_key)
    (scheduler,) = service_configs("scheduler", list(scheduler_args or []))
    base = local_stack(engine, scheduler, gateway, http=http)
    stack = Stack(
        engine=base.engine,
        scheduler=base.scheduler,
        gateway=base.gateway,
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
    """The echo engine (engine/fake.py) over the tiny byte vocabulary of tests/factories.py, with
    its EOS, behind a real scheduler and gateway; kwargs go to start_stack."""
    from tests.factories import EOS_TOKEN_ID, TINY_VOCAB

    return start_stack(
        fake=True,
        gateway_model=tokenizer_dir,
        engine_args=[
            "--fake-vocab-size", str(TINY_VOCAB), "--fake-eos-token-ids", str(EOS_TOKEN_ID),
            *engine_args,
        ],
        scheduler_args=list(scheduler),
        log_dir=log_dir,
        **kwargs,
    )  # fmt: skip
