"""One service run in this process: `llmserve engine | scheduler | gateway` (compose runs these)
and the children a launcher starts (`--config-stdin`: the configs arrive whole on stdin, and
the service stops when that pipe closes)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from llmserve.common.flags import from_flags, from_json
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.gateway.config import GatewayConfig
from llmserve.scheduler.config import SchedulerConfig

SERVICE_CONFIGS: dict[str, type] = {
    "engine": EngineConfig,
    "scheduler": SchedulerConfig,
    "gateway": GatewayConfig,
}
CONFIG_CLASSES = {c.__name__: c for c in (*SERVICE_CONFIGS.values(), EchoEngineConfig)}


def _read_parent_configs() -> list[Any]:
    """The configs a launcher wrote to our stdin (one JSON per line, then a blank line); then
    watch the pipe: when it closes, the launcher is gone and so are we."""
    configs = []
    for line in sys.stdin:
        if not line.strip():
            break
        configs.append(from_json(CONFIG_CLASSES, line))

    def watch() -> None:
        sys.stdin.read()  # returns at EOF: the launcher closed the pipe or died
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(15)
        os._exit(1)  # SIGTERM did not stop us in time

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    return configs


def _run_async(main: Any) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:
        asyncio.run(main)


def run_service(name: str, configs: list[Any]) -> None:
    """Run one service with its config (the engine: and the echo engine's, when faked) until
    SIGTERM / SIGINT."""
    from llmserve.common import telemetry
    from llmserve.common.log import configure

    config, tenants = configs[0], None
    if name == "engine":  # before torch loads libgomp, which reads them once
        from llmserve.engine.step.cpu_threads import configure_openmp

        configure_openmp()
    # Before anything slow (loading a model): an internal service refuses an exposed port
    # without protection; the gateway's port is the public one, it only reads its token (a bad
    # @PATH fails here).
    if name == "gateway":
        config.token()
        from llmserve.gateway.tenants import load_tenants

        tenants = load_tenants(config)  # read once; a wrong file fails before the tokenizer loads
    else:
        config.check_exposure(config.host)
    configure(name)
    nice = int(os.environ.get("LLMSERVE_NICE") or 0)
    if nice:  # before the service starts its threads: they inherit it (llmserve/stack.py)
        try:
            os.nice(nice)
        except PermissionError:  # a negative value without CAP_SYS_NICE: serve at 0
            logging.getLogger(name).warning("LLMSERVE_NICE=%d not permitted; running at 0", nice)
    # The gateway's HTTP API serves /metrics too (clients such as aiperf look for it there).
    registry = name == "gateway" and bool(getattr(config, "http_port", 0))
    telemetry.setup(name, config.metrics_port, config.host, registry)
    exit_code = None
    try:
        if name == "engine":
            exit_code = _run_engine(config, configs[1] if len(configs) > 1 else None)
        elif name == "scheduler":
            from llmserve.scheduler.service.service import serve

            _run_async(serve(config))
        else:
            from llmserve.gateway.service import serve as serve_gateway

            _run_async(serve_gateway(config, tenants))
    finally:
        telemetry.shutdown()
    if exit_code is not None:  # an engine group's node: see engine.ranks.run_node
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def _run_engine(config: EngineConfig, fake: EchoEngineConfig | None) -> int | None:
    """Serve until stopped; an engine group's node returns the code its process ends with."""
    from llmserve.engine.contract.service import serve

    if fake is not None:
        from llmserve.engine.contract.echo import EchoEngine

        serve(EchoEngine(config, fake), config)
    elif config.world_size > 1:
        from llmserve.engine.parallel.ranks import run_node

        return run_node(config)
    else:
        from llmserve.engine.step.engine import Engine

        serve(Engine(config), config)
    return None


def cmd_service(args: argparse.Namespace) -> int:
    try:
        if args.config_stdin:
            configs = _read_parent_configs()
        else:
            configs = [from_flags(SERVICE_CONFIGS[args.command], args)]
            if getattr(args, "fake", False):
                configs.append(from_flags(EchoEngineConfig, args, prefix="fake-"))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        run_service(args.command, configs)
    except Exception as err:  # the service stopped on a fatal error (already logged)
        print(f"error: {args.command}: {err}", file=sys.stderr)
        return 1
    return 0
