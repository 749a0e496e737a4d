"""Where the stack's processes listen: free loopback ports, each service's network settings, and
the replicas beyond the first (data parallelism: `--data-parallel-size D` runs D replicas, each a
scheduler and its engine on ports of their own, behind the one gateway). The first replica's
services keep their names and ports; replica i's are `scheduler-i` and `engine-i`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass, field, replace
from typing import Any

from llmserve.engine.config import EngineConfig
from llmserve.scheduler.config import SchedulerConfig

INTERNAL_HOST = "127.0.0.1"  # the engines and schedulers listen on loopback only


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports nothing listens on now (all held open while choosing)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on host:port (our child could not bind it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def local_address(host: str, port: int) -> str:
    """The address this machine reaches host:port at (a wildcard bind is reached on loopback)."""
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


@dataclass
class Group:
    """A replica beyond the first: a scheduler, its engine, and what their environment adds
    (the engine's GPU)."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    env: dict[str, str] = field(default_factory=dict)


def chosen_port(config: Any, name: str) -> int:
    """config's port `name` when it differs from the class default (chosen), else 0."""
    value: int = getattr(config, name)
    return value if value != getattr(type(config)(), name) else 0


def network_settings(host: str, ports: list[int], metrics_ports: list[int]) -> list[dict[str, Any]]:
    """The network settings of the engine, the scheduler and the gateway (ports and metrics
    ports in that order): the engine and the scheduler on loopback, the gateway on host."""
    internal = INTERNAL_HOST
    engine, scheduler, gateway = (
        {"port": p, "metrics_port": m} for p, m in zip(ports, metrics_ports, strict=True)
    )
    return [
        {**engine, "host": internal},
        {**scheduler, "host": internal, "engine_address": (f"{internal}:{ports[0]}",)},
        {**gateway, "host": host, "scheduler_address": f"{internal}:{ports[1]}"},
    ]


def replica_groups(
    engine: EngineConfig, scheduler: SchedulerConfig, data_parallel_size: int, ports: list[int]
) -> list[Group]:
    """Replicas 1..D-1 of (engine, scheduler) on loopback. ports: for each, its engine port,
    scheduler port, engine metrics port and scheduler metrics port (0: off). Each engine gets
    its own GPUs, one per rank of its group (T x P on this node): replica i the i-th such run
    of CUDA_VISIBLE_DEVICES (else of GPU ids); on a CPU, unless --num-threads chose, every rank
    of every engine (the first's too: see split_cpu) gets its share of the cores."""
    internal = INTERNAL_HOST
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    per_replica = engine.world_size // engine.nnodes
    groups = []
    for i in range(1, data_parallel_size):
        e, s, me, ms = ports[4 * (i - 1) : 4 * i]
        env = {}
        if engine.device != "cpu":
            ids = range(i * per_replica, (i + 1) * per_replica)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                visible[j] if len(visible) > j and visible[j] else str(j) for j in ids
            )
        group_engine = replace(engine, host=internal, port=e, metrics_port=me)
        group_scheduler = replace(
            scheduler, host=internal, port=s, metrics_port=ms, engine_address=(f"{internal}:{e}",)
        )
        groups.append(Group(group_engine, group_scheduler, env))
    return groups


def scheduler_addresses(first: str, groups: list[Group]) -> tuple[str, ...]:
    """The gateway's scheduler addresses: the first replica's (first), then each group's."""
    return (first, *(f"{INTERNAL_HOST}:{g.scheduler.port}" for g in groups))


def split_cpu(engine: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """engine with the CPU's cores shared among data_parallel_size engines and their ranks (CPU
    device, no --num-threads given: it then counts per rank); else unchanged."""
    if engine.device != "cpu" or engine.num_threads or data_parallel_size == 1:
        return engine
    ranks = data_parallel_size * engine.world_size // engine.nnodes
    return replace(engine, num_threads=max(1, (os.cpu_count() or 1) // ranks))


def check_roles(prefill_engines: int, decode_engines: int, data_parallel_size: int = 1) -> None:
    """ValueError unless (prefill, decode) engines are (0, 0), colocated, or both at least 1,
    with one replica (disaggregation with data parallelism is not built)."""
    if (prefill_engines, decode_engines) == (0, 0):
        return
    if prefill_engines < 1 or decode_engines < 1:
        raise ValueError(
            f"prefill_engines={prefill_engines}, decode_engines={decode_engines}: both at least "
            "1 (or both 0: one engine does both)"
        )
    if data_parallel_size != 1:
        raise ValueError(
            f"prefill and decode engines with data_parallel_size={data_parallel_size}: not "
            "built yet (one replica; more engines per role scale it instead)"
        )


def disaggregate(
    engine: EngineConfig,
    scheduler: SchedulerConfig,
    num_prefill: int,
    num_decode: int,
    metrics_ports: list[int] | None = None,
) -> tuple[list[EngineConfig], list[EngineConfig], SchedulerConfig]:
    """(prefill engines, decode engines, scheduler) from a colocated engine and its scheduler:
    the first decode engine where the engine was, the others on free loopback ports, each
    decode engine taking KV transfers on a free port; metrics_ports (None: off): the prefill
    engines' metrics ports, then the other decode engines'. On a CPU,
    unless --num-threads chose, the cores are shared among them. The scheduler drives them
    all."""
    engine = split_cpu(engine, num_prefill + num_decode)
    ports = free_ports(num_prefill + num_decode - 1)
    metrics = metrics_ports or [0] * len(ports)
    placed = [
        replace(engine, host=INTERNAL_HOST, port=port, metrics_port=m)
        for port, m in zip(ports, metrics, strict=True)
    ]
    # Speculation (n-grams) is the decode engines' only: a prefill engine samples one token.
    prefills = [
        replace(e, engine_role="prefill", speculative_method="none", speculative_model=None)
        for e in placed[:num_prefill]
    ]
    decodes = [replace(e, engine_role="decode") for e in [engine, *placed[num_prefill:]]]
    scheduler = replace(
        scheduler,
        engine_address=tuple(f"{e.host}:{e.port}" for e in decodes),
        prefill_engine_address=tuple(f"{e.host}:{e.port}" for e in prefills),
    )
    return prefills, decodes, scheduler


def role_engine_gpu(engine: EngineConfig, index: int) -> dict[str, str]:
    """Disaggregated, the environment of the engine at index among them all (0: the first
    decode engine, which sees every GPU and takes the first, as replica 0 does): on a GPU
    device, one GPU of its own, the index-th of CUDA_VISIBLE_DEVICES (else GPU id index); on a
    CPU, nothing (split_cpu shares the cores)."""
    if engine.device == "cpu" or index == 0:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    gpu = visible[index] if len(visible) > index and visible[index] else str(index)
    return {"CUDA_VISIBLE_DEVICES": gpu}


def check_data_parallel_size(data_parallel_size: int) -> None:
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")
