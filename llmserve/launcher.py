"""Starts the stack's processes, one child per service (`python -m llmserve.cli <service>
--config-stdin`), each handed its config whole through its stdin (the internal token with it:
never on a command line or in the environment). The pipe stays open: a child stops when it
closes, so the services die with whoever launched them, however it ended (Ctrl-C, SIGTERM,
SIGHUP, kill -9). `llmserve serve`, `llmserve bench` and the tests all start stacks
through `Stack`.

    stack = Stack(engine=EngineConfig(...), scheduler=SchedulerConfig(...),
                  gateway=GatewayConfig(...))
    stack.start()
    stack.wait_ready(timeout=600)      # our gateway answers SERVING, or StackError says why
    ...
    stack.stop()

With data parallelism (`--data-parallel-size D`) the Stack runs D replicas, each a scheduler and
its engine on ports of their own (`groups` beyond the first), behind the one gateway, which
routes between them (gateway/router.py). The first replica's services keep their names and
ports; replica i's are `scheduler-i` and `engine-i`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import grpc

from common.flags import to_json
from common.net import CHANNEL_OPTIONS, DEFAULT_GATEWAY_PORT, check_health
from engine.config import EngineConfig
from engine.fake import FakeEngineConfig
from gateway.config import GatewayConfig
from protos import api_pb2, api_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from scheduler.config import SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("engine", "scheduler", "gateway")  # start order; stopped front first
CONFIG_TYPES: tuple[type[Any], ...] = (EngineConfig, SchedulerConfig, GatewayConfig)  # as SERVICES


class StackError(RuntimeError):
    """The stack did not start (or a service died); the message says which and why."""


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


def _local(host: str, port: int) -> str:
    return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


@dataclass
class Group:
    """A replica beyond the first: a scheduler, its engine, and what their environment adds
    (the engine's GPU)."""

    engine: EngineConfig
    scheduler: SchedulerConfig
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Stack:
    engine: EngineConfig
    scheduler: SchedulerConfig
    gateway: GatewayConfig
    fake: FakeEngineConfig | None = None  # the echo engine instead of a model (tests)
    log_dir: Path | None = None  # each service's output in <name>.log; None: inherited
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)  # replicas 1..D-1 (data parallel)

    def __post_init__(self) -> None:
        """The internal links always carry a token: the one given, else a fresh one."""
        given = [c.internal_token for c in (self.engine, self.scheduler, self.gateway)]
        token = next((t for t in given if t), None) or secrets.token_urlsafe(32)
        for name in SERVICES:
            config = getattr(self, name)
            if not config.internal_token:
                setattr(self, name, replace(config, internal_token=token))
        for group in self.groups:
            for name in ("engine", "scheduler"):
                config = getattr(group, name)
                if not config.internal_token:
                    setattr(group, name, replace(config, internal_token=token))
        # wait_ready trusts only a gateway that reports this id: another server answering on
        # the gateway's port is not ours, however healthy.
        if not self.gateway.instance_id:
            self.gateway = replace(self.gateway, instance_id=uuid.uuid4().hex)

    @property
    def gateway_address(self) -> str:
        return _local(self.gateway.host, self.gateway.port)

    @property
    def scheduler_address(self) -> str:
        return _local(self.scheduler.host, self.scheduler.port)

    @property
    def engine_address(self) -> str:
        return _local(self.engine.host, self.engine.port)

    @property
    def scheduler_addresses(self) -> list[str]:
        """Every replica's scheduler, the first replica's first."""
        schedulers = [self.scheduler, *(g.scheduler for g in self.groups)]
        return [_local(c.host, c.port) for c in schedulers]

    def service_names(self) -> tuple[str, ...]:
        """Every service in start order: the engines, the schedulers, the gateway."""
        replicas = range(1, len(self.groups) + 1)
        return (
            "engine",
            *(f"engine-{i}" for i in replicas),
            "scheduler",
            *(f"scheduler-{i}" for i in replicas),
            "gateway",
        )

    def config_of(self, name: str) -> Any:
        """The config of service name (see service_names)."""
        kind, _, replica = name.partition("-")
        return getattr(self.groups[int(replica) - 1], kind) if replica else getattr(self, kind)

    def replica_services(self, replica: int) -> tuple[str, str]:
        """The (scheduler, engine) service names of replica (0 the first)."""
        suffix = f"-{replica}" if replica else ""
        return f"scheduler{suffix}", f"engine{suffix}"

    @property
    def http_url(self) -> str | None:
        port = self.gateway.http_port
        return f"http://{_local(self.gateway.host, port)}/v1" if port else None

    def check_ports_free(self) -> None:
        """Raise StackError naming the first port of the stack something else listens on."""
        for name in self.service_names():
            config = self.config_of(name)
            for port_field in ("port", "http_port", "metrics_port"):
                port = getattr(config, port_field, 0)
                if port and port_in_use(config.host, port):
                    raise StackError(
                        f"{name} {port_field.replace('_', ' ')} {port} is already in use on "
                        f"{config.host} (another server running?); stop it or choose another port"
                    )

    def start(self, names: tuple[str, ...] | None = None) -> None:
        for name in names or self.service_names():
            self.procs[name] = self._spawn(name)

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        kind, _, replica = name.partition("-")
        group_env = self.groups[int(replica) - 1].env if replica else {}
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **group_env}
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", kind, "--config-stdin"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # Ctrl-C reaches the launcher, which stops them in order
        )
        if out is not None:
            out.close()
        assert proc.stdin is not None
        fake = [self.fake] if kind == "engine" and self.fake is not None else []
        configs = [self.config_of(name), *fake]
        proc.stdin.write(("\n".join(to_json(c) for c in configs) + "\n\n").encode())
        proc.stdin.flush()  # kept open: closing it (or our death) stops the child
        return proc

    def dead(self) -> list[tuple[str, int]]:
        """(name, exit code) of every child that has exited."""
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def restart(self, name: str) -> None:
        """Start service name again (it died): a new child with the same config."""
        old = self.procs.pop(name, None)
        if old is not None:
            _close_stdin(old)
        self.start((name,))

    def wait_ready(self, timeout: float) -> None:
        """Return once our gateway reports SERVING with every replica ready; raise
        StackError if a child dies first, if another server answers on the gateway's port, or
        when timeout passes (with the end of the logs when they go to files)."""
        deadline = time.monotonic() + timeout
        while True:
            if check_health(self.gateway_address, timeout=1.0) == "SERVING":
                info = self._gateway_info()
                instance_id = info.instance_id if info is not None else None
                if info is not None and instance_id == self.gateway.instance_id:
                    if info.num_replicas_ready == len(self.scheduler_addresses):
                        return
                elif instance_id is not None:
                    raise StackError(
                        f"the gateway's port {self.gateway_address} is answered by another "
                        "server, not the gateway this launcher started; stop it or choose "
                        f"another port{self._log_tail()}"
                    )
            dead = self.dead()
            if dead or time.monotonic() > deadline:
                why = f"{dead[0][0]} exited with {dead[0][1]}" if dead else "timed out"
                raise StackError(f"the stack did not start ({why}){self._log_tail()}")
            time.sleep(0.2)

    def _gateway_info(self) -> api_pb2.ModelInfo | None:
        """The ModelInfo of the server on the gateway's port (one whose instance_id is "" for a
        server that is no gateway of ours), or None when it could not be asked now."""
        # A client key, else the internal token (the gateway takes it for GetModelInfo): with
        # --api-keys, the launcher may know no client key.
        key = self.gateway.api_key or self.gateway.token()
        metadata = (("authorization", f"Bearer {key}"),) if key else None
        with grpc.insecure_channel(self.gateway_address, options=CHANNEL_OPTIONS) as channel:
            stub = api_pb2_grpc.GenerationStub(channel)
            try:
                return stub.GetModelInfo(
                    api_pb2.GetModelInfoRequest(), timeout=2, metadata=metadata
                )
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                    return api_pb2.ModelInfo()
                return None

    def _log_tail(self) -> str:
        text = self.logs()
        return f"\n{text}" if text else ""

    def logs(self, num_chars: int = 4000) -> str:
        if self.log_dir is None:
            return ""
        return "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')[-num_chars:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def kill(self, name: str) -> None:
        """SIGKILL one service and reap it."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()
        _close_stdin(proc)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the front first (gateway, scheduler, engine); SIGKILL what lingers."""
        running = [self.procs[n] for n in reversed(self.service_names()) if n in self.procs]
        for proc in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            _close_stdin(proc)

    def scheduler_stats(self) -> scheduler_pb2.SchedulerStats:
        """The schedulers' stats summed over the replicas (one replica: its own)."""
        replicas = self.replica_stats()
        if len(replicas) == 1:
            return replicas[0]
        total = scheduler_pb2.SchedulerStats()
        for stats in replicas:
            for f in total.DESCRIPTOR.fields:
                if f.name != "ready":
                    _add_field(total, stats, f)
        total.ready = all(stats.ready for stats in replicas)
        return total

    def replica_stats(
        self, replicas: list[int] | None = None
    ) -> list[scheduler_pb2.SchedulerStats]:
        """Each replica's scheduler stats (those listed, else all), in replica order."""
        out = []
        addresses = self.scheduler_addresses
        for address in [addresses[i] for i in replicas] if replicas is not None else addresses:
            with self.scheduler.channel(address, aio=False) as channel:
                stub = scheduler_pb2_grpc.SchedulerStub(channel)
                request = scheduler_pb2.GetStatsRequest()
                metadata = self.scheduler.peer_metadata()
                out.append(stub.GetStats(request, timeout=10, metadata=metadata))
        return out

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _close_stdin(proc: subprocess.Popen[bytes]) -> None:
    if proc.stdin is not None and not proc.stdin.closed:
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()


def _chosen(config: Any, name: str) -> int:
    """config's port `name` when it differs from the class default (chosen), else 0."""
    value: int = getattr(config, name)
    return value if value != getattr(type(config)(), name) else 0


def _network(host: str, ports: list[int], metrics_ports: list[int]) -> list[dict[str, Any]]:
    """The network settings of the engine, the scheduler and the gateway (ports and metrics
    ports in that order): the engine and the scheduler on loopback, the gateway on host."""
    internal = "127.0.0.1"
    engine, scheduler, gateway = (
        {"port": p, "metrics_port": m} for p, m in zip(ports, metrics_ports, strict=True)
    )
    return [
        {**engine, "host": internal},
        {**scheduler, "host": internal, "engine_address": f"{internal}:{ports[0]}"},
        {**gateway, "host": host, "scheduler_address": f"{internal}:{ports[1]}"},
    ]


def _replica_groups(
    engine: EngineConfig, scheduler: SchedulerConfig, data_parallel_size: int, ports: list[int]
) -> list[Group]:
    """Replicas 1..D-1 of (engine, scheduler) on loopback. ports: for each, its engine port,
    scheduler port, engine metrics port and scheduler metrics port (0: off). Each engine gets
    its own GPUs, one per rank of its group (T x P on this node): replica i the i-th such run
    of CUDA_VISIBLE_DEVICES (else of GPU ids); on a CPU, unless --num-threads chose, every rank
    of every engine (the first's too: see split_cpu) gets its share of the cores."""
    internal = "127.0.0.1"
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
            scheduler, host=internal, port=s, metrics_port=ms, engine_address=f"{internal}:{e}"
        )
        groups.append(Group(group_engine, group_scheduler, env))
    return groups


def split_cpu(engine: EngineConfig, data_parallel_size: int) -> EngineConfig:
    """engine with the CPU's cores shared among data_parallel_size engines and their ranks (CPU
    device, no --num-threads given: it then counts per rank); else unchanged."""
    if engine.device != "cpu" or engine.num_threads or data_parallel_size == 1:
        return engine
    ranks = data_parallel_size * engine.world_size // engine.nnodes
    return replace(engine, num_threads=max(1, (os.cpu_count() or 1) // ranks))


def _check_data_parallel_size(data_parallel_size: int) -> None:
    if data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size} must be >= 1")


def local_stack(
    engine: EngineConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    gateway: GatewayConfig | None = None,
    *,
    http: bool = False,
    metrics: bool = False,
    data_parallel_size: int = 1,
    **kwargs: Any,
) -> Stack:
    """A Stack on free loopback ports (not started), with data_parallel_size replicas. The
    metrics and HTTP ports stay off unless a config chose one (or http=True / metrics=True:
    free ones; replicas beyond the first: free ones or off); the configs keep their other
    settings."""
    _check_data_parallel_size(data_parallel_size)
    given = (engine, scheduler, gateway)
    configs: list[Any] = [c or cls() for c, cls in zip(given, CONFIG_TYPES, strict=True)]
    configs[0] = split_cpu(configs[0], data_parallel_size)
    num_more = data_parallel_size - 1
    ports = free_ports(7 + 4 * num_more)
    chosen = [
        ports[4 + i] if metrics else _chosen(c, "metrics_port") for i, c in enumerate(configs)
    ]
    network = _network("127.0.0.1", ports[:3], chosen)
    network[2]["http_port"] = ports[3] if http else _chosen(configs[2], "http_port")
    more = ports[7:]
    if not metrics:  # each replica's engine and scheduler metrics ports off
        more = [p if i % 4 < 2 else 0 for i, p in enumerate(more)]
    groups = _replica_groups(configs[0], configs[1], data_parallel_size, more)
    network[2]["scheduler_address"] = (
        network[2]["scheduler_address"],
        *(f"127.0.0.1:{g.scheduler.port}" for g in groups),
    )
    stack_configs = (replace(c, **n) for c, n in zip(configs, network, strict=True))
    return Stack(*stack_configs, **{**kwargs, "groups": groups})


@contextlib.contextmanager
def serve_locally(
    serve_args: list[str],
    ready_timeout: float = 600.0,
    *,
    env: dict[str, str] | None = None,
    metrics: bool = False,
    fake: FakeEngineConfig | None = None,
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


def stats_delta(
    before: scheduler_pb2.SchedulerStats, after: scheduler_pb2.SchedulerStats
) -> dict[str, Any]:
    """The scheduler's counters accumulated between two scheduler_stats() readings, flat
    (gauges taken from after; a repeated counter, such as per proposal position, as a list)."""
    gauges = {"num_running", "num_waiting", "num_free_blocks", "num_blocks", "weight"}
    gauges |= {"ready", "draining"}

    def counter(k: str, a: float, b: float) -> float:
        return float(a) - (0.0 if k in gauges else float(b))

    delta: dict[str, Any] = {}
    for descriptor in after.DESCRIPTOR.fields:
        k = descriptor.name
        a, b = getattr(after, k), getattr(before, k)
        if k == "tenants":  # per tenant, by name: its counters' deltas, its gauges
            old = {t.tenant: t for t in b}
            rows: dict[str, dict[str, float]] = {}
            for t in a:
                was = old.get(t.tenant, type(t)())
                rows[t.tenant] = {
                    f.name: counter(f.name, getattr(t, f.name), getattr(was, f.name))
                    for f in t.DESCRIPTOR.fields
                    if f.name != "tenant"
                }
            delta[k] = rows
        elif isinstance(a, int | float):
            delta[k] = counter(k, a, b)
        elif hasattr(a, "keys"):  # a map of counters (preemptions by reason)
            delta[k] = {key: float(a[key]) - float(b.get(key, 0)) for key in a}
        else:  # a repeated counter (per proposal position)
            b = list(b) + [0] * (len(a) - len(b))
            delta[k] = [float(x - y) for x, y in zip(a, b, strict=False)]
    return delta


# -- `llmserve serve`'s flags: the three services' settings, each written once ---------------------

# Set per service by serve's own flags (--host, --port, --scheduler-port, ...), not shared.
_NETWORK = ("host", "port", "metrics_port", "engine_address", "scheduler_address")
_LAUNCHER = ("instance_id",)  # set by Stack itself
DEFAULT_METRICS_PORT = 9101  # gateway; scheduler +1, engine +2


def add_serve_flags(p: Any) -> None:
    """`llmserve serve`'s flags: its ports, then every engine, scheduler and gateway setting
    (a setting two services share, such as --model or --max-num-seqs, is one flag)."""
    from common.flags import add_flags

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
    """The gateway's file settings made absolute: its process runs in ROOT, not here."""
    paths = {}
    if gateway.api_keys:
        paths["api_keys"] = str(Path(gateway.api_keys).resolve())
    if gateway.admin_key and gateway.admin_key.startswith("@"):
        paths["admin_key"] = "@" + str(Path(gateway.admin_key[1:]).resolve())
    return paths


def stack_from_flags(args: Any, **kwargs: Any) -> Stack:
    """The Stack `llmserve serve` starts for its parsed flags: the engine and scheduler on
    loopback, the gateway on --host."""
    from common.flags import from_flags

    size = getattr(args, "data_parallel_size", 1)
    _check_data_parallel_size(size)
    ports = [args.engine_port, args.scheduler_port, args.port]
    metrics = [args.metrics_port + i if args.metrics_port else 0 for i in (2, 1, 0)]
    network = _network(args.host, ports, metrics)
    engine, scheduler, gateway = (
        from_flags(cls, args, **n) for cls, n in zip(CONFIG_TYPES, network, strict=True)
    )
    engine = split_cpu(engine, size)
    more: list[int] = []
    free = free_ports(2 * (size - 1))
    for i in range(1, size):
        m = [args.metrics_port + 2 + 2 * i, args.metrics_port + 1 + 2 * i]
        more += [free[2 * i - 2], free[2 * i - 1], *(m if args.metrics_port else [0, 0])]
    groups = _replica_groups(engine, scheduler, size, more)
    addresses = (gateway.scheduler_address[0], *(f"127.0.0.1:{g.scheduler.port}" for g in groups))
    gateway = replace(gateway, scheduler_address=addresses, **_absolute_paths(gateway))
    from gateway.tenants import load_tenants

    load_tenants(gateway)  # a wrong --api-keys file fails here, before anything starts
    return Stack(engine, scheduler, gateway, groups=groups, **kwargs)


def _add_field(total: Any, stats: Any, f: Any) -> None:
    """Add stats' field f into total's: numbers summed, bools or-ed, maps summed by key,
    repeated numbers summed by position, repeated messages (per-tenant rows) listed after."""
    mine, theirs = getattr(total, f.name), getattr(stats, f.name)
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        for key, value in theirs.items():
            mine[key] = mine[key] + value
    elif f.is_repeated and f.message_type is not None:
        mine.extend(theirs)
    elif f.is_repeated:
        summed = [a + b for a, b in itertools.zip_longest(mine, theirs, fillvalue=0)]
        del mine[:]
        mine.extend(summed)
    elif f.type == f.TYPE_BOOL:
        setattr(total, f.name, mine or theirs)
    else:
        setattr(total, f.name, mine + theirs)
