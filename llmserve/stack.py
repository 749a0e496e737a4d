"""Starts the stack's processes, one child per service (`python -m llmserve.cli <service>
--config-stdin`), each handed its config whole through its stdin (the internal token with it:
never on a command line or in the environment). The pipe stays open: a child stops when it
closes, so the services die with whoever launched them, however it ended (kill -9 included).
`llmserve serve`, `llmserve bench` and the tests all start stacks through `Stack`
(`start`, `wait_ready`, `stop`). Ports and replicas come from llmserve/topology.py; with
`--data-parallel-size D` replica i's services are `scheduler-i` and `engine-i`, and with
prefill engines they are named as docs/disaggregation.md's flag table says.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import grpc

from llmserve.common.flags import to_json
from llmserve.common.net import CHANNEL_OPTIONS, check_health
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.gateway.config import GatewayConfig
from llmserve.protos import api_pb2, api_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from llmserve.scheduler.config import SchedulerConfig
from llmserve.stats import summed_stats
from llmserve.topology import (
    Group,
    check_data_parallel_size,
    check_roles,
    chosen_port,
    disaggregate,
    free_ports,
    local_address,
    network_settings,
    port_in_use,
    replica_groups,
    role_engine_gpu,
    scheduler_addresses,
    split_cpu,
)

SERVICES = ("engine", "scheduler", "gateway")  # start order; stopped front first
# The scheduler's and gateway's nice value beside an engine on the CPU (LLMSERVE_FRONT_NICE sets
# another; 0: none): their per-token wake-ups then wait for a gap rather than preempt one of the
# engine's OpenMP threads, which stalls the other at the next barrier. One stream on the 2-core
# VM beside other work, ITL p50 24.0-31.7 ms at 0, 20.5-23.0 at 5 (docs/quantization.md, issue
# 42's third session); vLLM's CPU server leaves its front end a core for the same reason.
FRONT_NICE = 5
# Each service's config type, in SERVICES' order.
CONFIG_TYPES: tuple[type[Any], ...] = (EngineConfig, SchedulerConfig, GatewayConfig)


class StackError(RuntimeError):
    """The stack did not start (or a service died); the message says which and why."""


@dataclass
class Stack:
    engine: EngineConfig
    scheduler: SchedulerConfig
    gateway: GatewayConfig
    fake: EchoEngineConfig | None = None  # the echo engine instead of a model (tests)
    log_dir: Path | None = None  # each service's output in <name>.log; None: inherited
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    groups: list[Group] = field(default_factory=list)  # replicas 1..D-1 (data parallel)
    # Disaggregated: the prefill engines, and the decode engines beyond `engine` (the first).
    prefill_engines: list[EngineConfig] = field(default_factory=list)
    decode_engines: list[EngineConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        """The internal links always carry a token: the one given, else a fresh one."""
        given = [c.internal_token for c in (self.engine, self.scheduler, self.gateway)]
        token = next((t for t in given if t), None) or secrets.token_urlsafe(32)
        for name in SERVICES:
            config = getattr(self, name)
            if not config.internal_token:
                setattr(self, name, replace(config, internal_token=token))
        for engines in (self.prefill_engines, self.decode_engines):
            engines[:] = [replace(e, internal_token=e.internal_token or token) for e in engines]
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
        return local_address(self.gateway.host, self.gateway.port)

    @property
    def scheduler_address(self) -> str:
        return local_address(self.scheduler.host, self.scheduler.port)

    @property
    def engine_address(self) -> str:
        return local_address(self.engine.host, self.engine.port)

    @property
    def scheduler_addresses(self) -> list[str]:
        """Every replica's scheduler, the first replica's first."""
        schedulers = [self.scheduler, *(g.scheduler for g in self.groups)]
        return [local_address(c.host, c.port) for c in schedulers]

    def service_names(self) -> tuple[str, ...]:
        """Every service in start order: the engines, the schedulers, the gateway."""
        replicas = range(1, len(self.groups) + 1)
        return (
            "engine",
            *(f"engine-{i}" for i in replicas),
            *self._role_engines(),
            "scheduler",
            *(f"scheduler-{i}" for i in replicas),
            "gateway",
        )

    def _role_engines(self) -> dict[str, EngineConfig]:
        """Disaggregated: the prefill engines and the decode engines beyond the first, by
        service name."""
        named = {}
        for role, engines in (("prefill", self.prefill_engines), ("decode", self.decode_engines)):
            first = 1 if role == "prefill" else 2
            for i, engine in enumerate(engines, first):
                named[f"engine-{role}" + (f"-{i}" if i > 1 else "")] = engine
        return named

    @property
    def prefill_engine(self) -> EngineConfig | None:
        """The first prefill engine, if any."""
        return self.prefill_engines[0] if self.prefill_engines else None

    def config_of(self, name: str) -> Any:
        """The config of service name (see service_names)."""
        if name.startswith(("engine-prefill", "engine-decode")):
            return self._role_engines()[name]
        kind, _, replica = name.partition("-")
        return getattr(self.groups[int(replica) - 1], kind) if replica else getattr(self, kind)

    def replica_services(self, replica: int) -> tuple[str, str]:
        """The (scheduler, engine) service names of replica (0 the first)."""
        suffix = f"-{replica}" if replica else ""
        return f"scheduler{suffix}", f"engine{suffix}"

    @property
    def http_url(self) -> str | None:
        port = self.gateway.http_port
        return f"http://{local_address(self.gateway.host, port)}/v1" if port else None

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

    def env_of(self, name: str) -> dict[str, str]:
        """What service name's environment adds to this process's: the stack's, and its
        replica's or, disaggregated, its engine's (its GPU; the first decode engine: GPU 0)."""
        _, _, replica = name.partition("-")
        own = self.groups[int(replica) - 1].env if replica.isdigit() else {}
        roles = list(self._role_engines())
        if name in roles:
            own = role_engine_gpu(self.engine, 1 + roles.index(name))
        nice = {}
        if name.partition("-")[0] in ("scheduler", "gateway") and self.engine_on_cpu():
            given = {**os.environ, **self.env}.get("LLMSERVE_FRONT_NICE", str(FRONT_NICE))
            nice["LLMSERVE_NICE"] = given
        return {"PYTHONUNBUFFERED": "1", **nice, **self.env, **own}

    def engine_on_cpu(self) -> bool:
        """Whether the engines run on this machine's CPU: --device cpu, or auto without an
        NVIDIA device node (the launcher does not load torch to ask)."""
        device = self.engine.device
        return device == "cpu" or (device == "auto" and not Path("/dev/nvidiactl").exists())

    def _spawn(self, name: str) -> subprocess.Popen[bytes]:
        kind = name.partition("-")[0]
        env = {**os.environ, **self.env_of(name)}
        out: IO[bytes] | None = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            # In the launcher's own directory, as the user started it: relative paths mean
            # the same in every service, and an installed llmserve needs no checkout.
            [sys.executable, "-m", "llmserve.cli", kind, "--config-stdin"],
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
        return summed_stats(self.replica_stats())

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


def local_stack(
    engine: EngineConfig | None = None,
    scheduler: SchedulerConfig | None = None,
    gateway: GatewayConfig | None = None,
    *,
    http: bool = False,
    metrics: bool = False,
    data_parallel_size: int = 1,
    prefill_engines: int = 0,
    decode_engines: int | None = None,
    **kwargs: Any,
) -> Stack:
    """A Stack on free loopback ports (not started), with data_parallel_size replicas (or,
    with prefill_engines=N, N prefill engines and decode_engines (default: N) decode engines
    under the one scheduler). The
    metrics and HTTP ports stay off unless a config chose one (or http=True / metrics=True:
    free ones; replicas beyond the first: free ones or off); the configs keep their other
    settings."""
    check_data_parallel_size(data_parallel_size)
    if decode_engines is None:
        decode_engines = prefill_engines
    check_roles(prefill_engines, decode_engines, data_parallel_size)
    given = (engine, scheduler, gateway)
    configs: list[Any] = [c or cls() for c, cls in zip(given, CONFIG_TYPES, strict=True)]
    configs[0] = split_cpu(configs[0], data_parallel_size)
    num_more = data_parallel_size - 1
    ports = free_ports(7 + 4 * num_more)
    chosen = [
        ports[4 + i] if metrics else chosen_port(c, "metrics_port") for i, c in enumerate(configs)
    ]
    network = network_settings("127.0.0.1", ports[:3], chosen)
    network[2]["http_port"] = ports[3] if http else chosen_port(configs[2], "http_port")
    more = ports[7:]
    if not metrics:  # each replica's engine and scheduler metrics ports off
        more = [p if i % 4 < 2 else 0 for i, p in enumerate(more)]
    groups = replica_groups(configs[0], configs[1], data_parallel_size, more)
    network[2]["scheduler_address"] = scheduler_addresses(network[2]["scheduler_address"], groups)
    engine, scheduler, gateway = (replace(c, **n) for c, n in zip(configs, network, strict=True))
    prefills: list[EngineConfig] = []
    decodes = [engine]
    if prefill_engines:
        num = prefill_engines + decode_engines - 1
        prefills, decodes, scheduler = disaggregate(
            engine, scheduler, prefill_engines, decode_engines, free_ports(num) if metrics else None
        )
    return Stack(
        decodes[0],
        scheduler,
        gateway,
        **{**kwargs, "groups": groups},
        prefill_engines=prefills,
        decode_engines=decodes[1:],
    )
