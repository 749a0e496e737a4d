"""A local `llmserve serve` on free loopback ports, for `bench offline` and the batching study.

    with LocalStack.start(["--max-num-seqs", "16", "--scheduling-policy", "static"]) as stack:
        ...  # stack.gateway_address, stack.scheduler_stats()

The arguments are `llmserve serve`'s own, checked by its parser before anything starts.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.fake import FakeEngineConfig
from llmserve.launcher import (
    SERVICES,
    Stack,
    add_serve_flags,
    free_port,
    local_stack,
    stack_from_flags,
)


def parse_serve_args(serve_args: list[str]) -> argparse.Namespace:
    """`llmserve serve`'s parse of serve_args; exits with its usage message when they are bad."""
    parser = argparse.ArgumentParser(prog="llmserve serve")
    add_serve_flags(parser)
    return parser.parse_args(serve_args)


class LocalStack:
    def __init__(self, stack: Stack, log_dir: Path):
        self.stack = stack
        self.log_dir = log_dir
        self.gateway_address = stack.gateway_address

    @classmethod
    def start(
        cls,
        serve_args: list[str],
        ready_timeout: float = 600.0,
        *,
        env: dict[str, str] | None = None,
        metrics: bool = False,
        fake: FakeEngineConfig | None = None,
    ) -> LocalStack:
        """Start the three processes and return once the gateway serves; env: extra variables
        for them; metrics: each serves /metrics on a free port (else off); fake: the echo engine
        instead of the model. On failure, raise RuntimeError (launcher.StackError) with the end
        of the stack's logs."""
        configured = stack_from_flags(parse_serve_args(serve_args))
        log_dir = Path(tempfile.mkdtemp(prefix="llmserve-bench-"))
        stack = local_stack(
            configured.engine,
            configured.scheduler,
            configured.gateway,
            fake=fake,
            log_dir=log_dir,
            env={"LLMSERVE_LOG_LEVEL": "WARNING", **(env or {})},
        )
        if metrics:
            for name in SERVICES:
                setattr(stack, name, replace(getattr(stack, name), metrics_port=free_port()))
        local = cls(stack, log_dir)
        try:
            stack.start()
            stack.wait_ready(ready_timeout)
        except BaseException:
            local.stop()
            raise
        return local

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.stack.logs(num_chars)

    def scheduler_stats(self) -> dict[str, float]:
        """The scheduler's counters (GetStats) as a flat dict."""
        from google.protobuf.json_format import MessageToDict

        fields = MessageToDict(
            self.stack.scheduler_stats(),
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        return {k: float(v) for k, v in fields.items() if isinstance(v, int | float | str)}

    def stop(self) -> None:
        self.stack.stop(timeout=30)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


def stats_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters accumulated between two scheduler_stats() readings (gauges taken from after)."""
    gauges = {"num_running", "num_waiting", "num_free_blocks", "num_blocks"}
    return {k: v if k in gauges else v - before.get(k, 0.0) for k, v in after.items()}
