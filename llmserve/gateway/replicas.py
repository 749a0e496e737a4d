"""The gateway's links to its scheduler replicas: which addresses there are (dns:/// names looked
up again every few seconds), what each serves (GetInfo: the first replica's limits become the
gateway's), and each one's load and health from the stats it streams (WatchStats). A replica
whose stream breaks or falls silent for HEARTBEAT_S is routed around, and its requests in flight
are cancelled here (each fails over, or fails UNAVAILABLE if it had streamed: gateway/streaming.py)
until its stats come back. The gateway is SERVING (gRPC health, HTTP /ready) while a replica is
and it is not draining.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2

from llmserve.common.log import get_logger
from llmserve.gateway.config import DNS_PREFIX, GatewayConfig
from llmserve.gateway.router import Replica, ReplicaLoad, Router
from llmserve.gateway.validation import Limits
from llmserve.protos import scheduler_pb2, scheduler_pb2_grpc

log = get_logger("gateway")

HEARTBEAT_S = 1.0  # a replica whose stats stream is silent this long is routed around
STATS_INTERVAL_MS = 250  # how often each scheduler pushes its stats
DNS_REFRESH_S = 5.0  # dns:/// scheduler addresses are looked up again this often
MISMATCH_RETRY_S = 10.0  # a replica serving something else is asked again this often
STATS_WINDOW_S = 5.0  # steps per second are measured over this much of the stats stream


@dataclass(eq=False)
class Attempt:
    """One Submit call of a request to one replica. lost: the replica was declared lost while
    it ran (its call was cancelled by us, not by the client)."""

    call: grpc.aio.UnaryStreamCall
    lost: bool = False
    aborted: str | None = None  # an operator aborted the request: why


@dataclass(eq=False)
class ReplicaLink:
    """The gateway's connection to one replica's scheduler."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    info: scheduler_pb2.SchedulerInfo | None = None
    attempts: set[Attempt] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    stats: scheduler_pb2.SchedulerStats | None = None  # the last its scheduler sent
    # (monotonic time, num_steps) of the stats of the last STATS_WINDOW_S: steps per second.
    steps: deque[tuple[float, int]] = field(default_factory=deque)

    def on_stats(self, stats: scheduler_pb2.SchedulerStats, now: float) -> None:
        self.stats = stats
        self.steps.append((now, stats.num_steps))
        while len(self.steps) > 2 and now - self.steps[1][0] >= STATS_WINDOW_S:
            self.steps.popleft()

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters its scheduler serves, as its last stats said."""
        return list(self.stats.lora_names) if self.stats is not None else []

    @property
    def steps_per_s(self) -> float:
        if len(self.steps) < 2 or self.steps[-1][0] <= self.steps[0][0]:
            return 0.0
        (t0, n0), (t1, n1) = self.steps[0], self.steps[-1]
        return max(0, n1 - n0) / (t1 - t0)


class ReplicaMismatch(Exception):
    """A replica serves something else than the first one did (model, limits, block size)."""


class ReplicaLinks:
    """One link per scheduler replica, the router over them, the first replica's limits, and
    the gateway's readiness. GatewayCore (gateway/core.py) is one, with the request path on top.
    """

    def __init__(self, config: GatewayConfig, model_id: str):
        self.config = config
        self.model_id = model_id
        self.peer_metadata = config.peer_metadata()
        self.router = Router([], config.routing, config.routing_spill_threshold)
        self.links: dict[str, ReplicaLink] = {}
        self.info: scheduler_pb2.SchedulerInfo | None = None  # the first replica's
        self.limits: Limits | None = None
        # The gRPC health service: SERVING while a replica is; `serving` is the same, for HTTP.
        self.health = health.aio.HealthServicer()
        self.serving = False
        self.draining = False
        self._health_update: asyncio.Future[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()  # links being closed

    async def watch_scheduler(self) -> None:
        """Keep one link per scheduler address (dns:/// names resolved again every
        DNS_REFRESH_S), each watched by its own task (watch_replica). Runs until cancelled."""
        try:
            while True:
                addresses = await resolve_addresses(self.config.scheduler_address)
                self._set_links(addresses)
                if not any(a.startswith(DNS_PREFIX) for a in self.config.scheduler_address):
                    await asyncio.Event().wait()  # fixed addresses: nothing to look up again
                await asyncio.sleep(DNS_REFRESH_S)
        finally:
            for link in list(self.links.values()):
                await self._close_link(link)

    def _set_links(self, addresses: list[str]) -> None:
        """Open links to new addresses; close those no longer listed (their requests fail over
        as for a lost replica). An empty lookup keeps the links there are."""
        if not addresses or addresses == list(self.links):
            return
        log.info("scheduler replicas", addresses=addresses)
        for address in [a for a in self.links if a not in addresses]:
            link = self.links.pop(address)
            self._lose(link)
            closing = asyncio.ensure_future(self._close_link(link))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)
        for address in addresses:
            if address not in self.links:
                channel = self.config.channel(address)
                link = ReplicaLink(address, channel, scheduler_pb2_grpc.SchedulerStub(channel))
                link.task = asyncio.create_task(self.watch_replica(link))
                self.links[address] = link
        self.router.set_replicas(addresses)

    async def _close_link(self, link: ReplicaLink) -> None:
        if link.task is not None:
            link.task.cancel()
            await asyncio.gather(link.task, return_exceptions=True)
        await link.channel.close()

    async def watch_replica(self, link: ReplicaLink) -> None:
        """Learn link's limits (GetInfo), then follow its stats stream: each message is its
        load and health for the router; a broken stream, or none for HEARTBEAT_S, takes it out
        of routing (and fails over its requests) until its stats come back."""
        while True:
            try:
                if link.info is None:
                    info = await link.stub.GetInfo(
                        scheduler_pb2.GetInfoRequest(), timeout=2, metadata=self.peer_metadata
                    )
                    self._adopt_info(link, info)
                await self._follow_stats(link)
            except (grpc.aio.AioRpcError, TimeoutError) as err:
                why = err.code().name if isinstance(err, grpc.aio.AioRpcError) else "silent"
                if self.router.replicas.get(link.address, Replica("")).reachable:
                    log.warning("scheduler replica lost", address=link.address, why=why)
            except ReplicaMismatch as err:
                log.error("refusing a scheduler replica", address=link.address, error=str(err))
                await asyncio.sleep(MISMATCH_RETRY_S)
            except Exception:
                log.exception("watching a scheduler replica failed", address=link.address)
            self._lose(link)
            await asyncio.sleep(0.5)

    async def _follow_stats(self, link: ReplicaLink) -> None:
        request = scheduler_pb2.WatchStatsRequest(interval_ms=STATS_INTERVAL_MS)
        stream = link.stub.WatchStats(request, metadata=self.peer_metadata)
        try:
            messages = aiter(stream)
            while True:
                stats = await asyncio.wait_for(anext(messages), HEARTBEAT_S)
                link.on_stats(stats, time.monotonic())
                self.router.on_stats(link.address, stats.ready, replica_load(stats))
                self._update_health()
        except StopAsyncIteration:
            return  # the scheduler is stopping
        finally:
            stream.cancel()

    def _adopt_info(self, link: ReplicaLink, info: scheduler_pb2.SchedulerInfo) -> None:
        """The first replica's limits become the gateway's; a later replica must agree on
        what validation and routing depend on, else ReplicaMismatch."""
        if self.info is None:
            self.info = info
            self.limits = Limits(
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
                kv_capacity_tokens=info.num_blocks * info.block_size,
                max_waiting=info.max_waiting,
            )
            self.router.block_size = info.block_size
            log.info(
                "scheduler connected",
                model=self.model_id,
                engine_model=info.model,
                max_model_len=info.max_model_len,
            )
        for name in ("model", "max_model_len", "vocab_size", "block_size"):
            ours, theirs = getattr(self.info, name), getattr(info, name)
            if ours != theirs:
                raise ReplicaMismatch(
                    f"{name}={theirs!r} at {link.address}, but {ours!r} at the first replica"
                )
        link.info = info

    def _lose(self, link: ReplicaLink) -> None:
        """Route around link; cancel its requests in flight (each fails over, or fails
        UNAVAILABLE if it had streamed)."""
        self.router.on_lost(link.address)
        link.stats = None
        link.steps.clear()
        for attempt in list(link.attempts):
            attempt.lost = True
            attempt.call.cancel()
        self._update_health()

    def _update_health(self) -> None:
        serving = self.router.num_healthy > 0 and not self.draining
        if serving != self.serving or self._health_update is None:
            self.serving = serving
            response = health_pb2.HealthCheckResponse
            status = response.SERVING if serving else response.NOT_SERVING
            self._health_update = asyncio.ensure_future(self.health.set("", status))

    def set_draining(self, draining: bool) -> None:
        """Stop (or restart) admitting; readiness follows (NOT_SERVING while draining)."""
        self.draining = draining
        self._update_health()

    async def close(self) -> None:
        for link in list(self.links.values()):
            await self._close_link(link)
        self.links.clear()


def replica_load(stats: scheduler_pb2.SchedulerStats) -> ReplicaLoad:
    used = stats.num_blocks - stats.num_free_blocks
    return ReplicaLoad(
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_usage=used / stats.num_blocks if stats.num_blocks else 0.0,
    )


async def resolve_addresses(addresses: tuple[str, ...]) -> list[str]:
    """addresses with each dns:///NAME:PORT replaced by IP:PORT for every address NAME resolves
    to now (sorted; none when it does not resolve)."""
    out: list[str] = []
    loop = asyncio.get_running_loop()
    for address in addresses:
        if not address.startswith(DNS_PREFIX):
            out.append(address)
            continue
        host, _, port = address.removeprefix(DNS_PREFIX).rpartition(":")
        try:
            infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as err:
            log.warning("scheduler name does not resolve", address=address, error=str(err))
            continue
        ips = sorted({str(info[4][0]) for info in infos})
        out.extend(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for ip in ips)
    return out
