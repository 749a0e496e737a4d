"""`llmserve serve`'s flags (the three services' settings, each written once) and the Stack
they describe: `stack_from_flags` for `llmserve serve` itself, `serve_locally` for `llmserve bench
offline` and the bench/ scripts (the same flags on free loopback ports)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from llmserve.common.net import DEFAULT_GATEWAY_PORT
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.gateway.config import GatewayConfig, model_names
from llmserve.stack import CONFIG_TYPES, SERVICES, Stack, local_stack
from llmserve.topology import (
    check_data_parallel_size,
    check_roles,
    disaggregate,
    free_ports,
    network_settings,
    replica_groups,
    scheduler_addresses,
    split_cpu,
)

_NETWORK = (
    "host", "port", "metrics_port", "engine_address", "scheduler_address",
    "prefill_engine_address", "engine_role", "kv_transfer_port", "kv_transfer_host",
)  # fmt: skip
_LAUNCHER = ("instance_id",)  # set by Stack itself
DEFAULT_METRICS_PORT = 9101  # gateway; scheduler +1, engine +2


def add_serve_flags(p: Any) -> None:
    """`llmserve serve`'s flags: its ports, then every engine, scheduler and gateway setting
    (a setting two services share, such as --model or --max-num-seqs, is one flag)."""
    from llmserve.common.flags import add_flags

    p.add_argument("--host", default="127.0.0.1", help="gateway bind address (0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway gRPC port")
    p.add_argument("--scheduler-port", type=int, default=50052)
    p.add_argument("--engine-port", type=int, default=50053)
    env = os.environ.get("LLMSERVE_METRICS_PORT")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env) if env else DEFAULT_METRICS_PORT,
        help="the gateway's Prometheus /metrics port; the scheduler's is PORT+1, the engine's "
        "PORT+2; 0 turns them off (env LLMSERVE_METRICS_PORT). Traces and OTLP metrics: the "
        "standard OTEL_* variables",
    )
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to start")
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="replicas, each a scheduler and its engine (its own GPU; on a CPU, cores / D "
        "threads each), behind the one gateway, which routes between them (--routing). The "
        "first replica's ports are --scheduler-port and --engine-port, the others' free ones; "
        "metrics: replica i's scheduler at PORT+1+2i, its engine at PORT+2+2i",
    )
    p.add_argument(
        "--prefill-engines",
        type=int,
        default=0,
        help="prefill / decode disaggregation (docs/disaggregation.md): engines that run "
        "prompts and send their KV to a decode engine (with --decode-engines; 0 and 0: one "
        "engine does both). They listen on free loopback ports; metrics, when on, at PORT+3, "
        "PORT+4, ...",
    )
    p.add_argument(
        "--decode-engines",
        type=int,
        default=0,
        help="engines that take the prompts' KV and decode (with --prefill-engines); the first "
        "is the one on --engine-port, the others on free ports (metrics after the prefill "
        "engines')",
    )
    taken: set[str] = set()
    for cls, title in zip(CONFIG_TYPES, SERVICES, strict=True):
        add_flags(p.add_argument_group(title), cls, exclude=_NETWORK + _LAUNCHER, taken=taken)


def parse_serve_flags(argv: list[str]) -> Any:
    """`llmserve serve`'s parse of argv; exits with its usage message when they are bad."""
    import argparse

    parser = argparse.ArgumentParser(prog="llmserve serve")
    add_serve_flags(parser)
    return parser.parse_args(argv)


def _absolute_paths(gateway: GatewayConfig) -> dict[str, str]:
    """The gateway's file settings made absolute, so that its config means the same whatever
    directory reads it."""
    paths = {}
    if gateway.api_keys:
        paths["api_keys"] = str(Path(gateway.api_keys).resolve())
    if gateway.admin_key and gateway.admin_key.startswith("@"):
        paths["admin_key"] = "@" + str(Path(gateway.admin_key[1:]).resolve())
    return paths


def stack_from_flags(args: Any, **kwargs: Any) -> Stack:
    """The Stack `llmserve serve` starts for its parsed flags: the engine and scheduler on
    loopback, the gateway on --host."""
    from llmserve.common.flags import from_flags

    size = getattr(args, "data_parallel_size", 1)
    check_data_parallel_size(size)
    ports = [args.engine_port, args.scheduler_port, args.port]
    metrics = [args.metrics_port + i if args.metrics_port else 0 for i in (2, 1, 0)]
    network = network_settings(args.host, ports, metrics)
    engine, scheduler, gateway = (
        from_flags(cls, args, **n) for cls, n in zip(CONFIG_TYPES, network, strict=True)
    )
    engine = split_cpu(engine, size)
    # Adapter directories made absolute: they are listed to clients and to the engine.
    modules = [f"{name}={Path(path).resolve()}" for name, path in scheduler.lora_paths().items()]
    for name in model_names(gateway):
        if name in scheduler.lora_paths():
            raise ValueError(f"--lora-modules: {name!r} names the base model: name it otherwise")
    scheduler = replace(scheduler, lora_modules=tuple(modules))
    more: list[int] = []
    free = free_ports(2 * (size - 1))
    for i in range(1, size):
        m = [args.metrics_port + 2 + 2 * i, args.metrics_port + 1 + 2 * i]
        more += [free[2 * i - 2], free[2 * i - 1], *(m if args.metrics_port else [0, 0])]
    groups = replica_groups(engine, scheduler, size, more)
    addresses = scheduler_addresses(gateway.scheduler_address[0], groups)
    gateway = replace(gateway, scheduler_address=addresses, **_absolute_paths(gateway))
    from llmserve.gateway.tenants import load_tenants

    load_tenants(gateway)  # a wrong --api-keys file fails here, before anything starts
    roles = (getattr(args, "prefill_engines", 0), getattr(args, "decode_engines", 0))
    check_roles(*roles, size)
    prefills: list[EngineConfig] = []
    decodes = [engine]
    if roles[0]:
        num = sum(roles) - 1
        base = args.metrics_port
        metrics_ports = [base + 3 + i for i in range(num)] if base else None
        prefills, decodes, scheduler = disaggregate(engine, scheduler, *roles, metrics_ports)
    return Stack(
        decodes[0],
        scheduler,
        gateway,
        groups=groups,
        prefill_engines=prefills,
        decode_engines=decodes[1:],
        **kwargs,
    )


@contextlib.contextmanager
def serve_locally(
    serve_args: list[str],
    ready_timeout: float = 600.0,
    *,
    env: dict[str, str] | None = None,
    metrics: bool = False,
    fake: EchoEngineConfig | None = None,
) -> Iterator[Stack]:
    """`llmserve serve serve_args` on free loopback ports, for `bench offline` and the scripts:
    serving inside the with block, stopped (and its logs deleted) after. env: extra variables
    for the services; metrics: each serves /metrics on a free port (else off); fake: the echo
    engine instead of the model. Raises StackError, with the end of the logs, when it does not
    start; exits with serve's usage message when serve_args are bad."""
    args = parse_serve_flags(serve_args)
    configured = stack_from_flags(args)
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-", ignore_cleanup_errors=True) as logs:
        stack = local_stack(
            configured.engine,
            configured.scheduler,
            configured.gateway,
            data_parallel_size=args.data_parallel_size,
            prefill_engines=args.prefill_engines,
            decode_engines=args.decode_engines,
            metrics=metrics,
            fake=fake,
            log_dir=Path(logs),
            env={"LLMSERVE_LOG_LEVEL": "WARNING", **(env or {})},
        )
        try:
            stack.start()
            stack.wait_ready(ready_timeout)
            yield stack
        finally:
            stack.stop(timeout=30)
