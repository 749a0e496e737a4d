"""The request path both APIs share, the gRPC Generation service and the OpenAI-compatible HTTP
API, in front of the same scheduler connection:

    validate -> submit to the scheduler -> detokenize + stop strings -> stream text

Each phase is one method. Closing or cancelling a `generate` stream (its client went away) cancels
the Submit call upstream: the scheduler then aborts the request and frees its blocks before its
next step. A stop string ends the request the same way, after the text before it has been sent.

A request the server ends itself (the scheduler's finish reason ABORT: it is shutting down, or its
engine came back too small to hold the request) and one whose scheduler was lost mid-stream are
UNAVAILABLE errors, which a client can retry, never a finish reason.
"""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2

from common.log import get_logger
from common.model_config import default_model_id
from gateway.config import DNS_PREFIX, GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.router import Replica, ReplicaLoad, Router
from gateway.stop import StopStringMatcher
from gateway.telemetry import GatewayTelemetry, RequestTelemetry
from gateway.tokenizer import Tokenizer
from gateway.validation import Limits, ValidationError, ValidRequest, validate
from protos import api_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = get_logger("gateway")

REPLICA_SILENT_MESSAGE = "its scheduler stopped answering"
HEARTBEAT_S = 1.0  # a replica whose stats stream is silent this long is routed around
STATS_INTERVAL_MS = 250  # how often each scheduler pushes its stats
DNS_REFRESH_S = 5.0  # dns:/// scheduler addresses are looked up again this often
MISMATCH_RETRY_S = 10.0  # a replica serving something else is asked again this often
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
SERVER_ENDED_MESSAGE = (
    "the server ended this request before it finished (shutting down, or its engine was lost); "
    "retry"
)


class GatewayError(Exception):
    """A request refused or failed. `code` is the gRPC status (the design's failure vocabulary);
    the HTTP API maps it to an HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(eq=False)
class Attempt:
    """One Submit call of a request to one replica. lost: the replica was declared lost while
    it ran (its call was cancelled by us, not by the client)."""

    call: grpc.aio.UnaryStreamCall
    lost: bool = False


@dataclass(eq=False)
class ReplicaLink:
    """The gateway's connection to one replica's scheduler."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    info: scheduler_pb2.SchedulerInfo | None = None
    attempts: set[Attempt] = field(default_factory=set)
    task: asyncio.Task[None] | None = None


class GatewayCore:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        # What both APIs call the model (the engine's own name for it is only logged).
        self.model_id = config.served_model_name or default_model_id(config.model)
        self.peer_metadata = config.peer_metadata()
        self.router = Router([], config.routing, config.routing_spill_threshold)
        self.links: dict[str, ReplicaLink] = {}
        self.info: scheduler_pb2.SchedulerInfo | None = None  # the first replica's
        self.limits: Limits | None = None
        # The gRPC health service: SERVING while a replica is; `serving` is the same, for HTTP.
        self.health = health.aio.HealthServicer()
        self.serving = False
        self.telemetry = GatewayTelemetry()
        self.telemetry.model = self.model_id
        self._health_update: asyncio.Future[None] | None = None
        self._closing: set[asyncio.Future[None]] = set()  # links being closed

    # -- replicas --------------------------------------------------------------------------------

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
                self.router.on_stats(link.address, stats.ready, _load(stats))
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
        for attempt in list(link.attempts):
            attempt.lost = True
            attempt.call.cancel()
        self._update_health()

    def _update_health(self) -> None:
        serving = self.router.num_healthy > 0
        if serving != self.serving or self._health_update is None:
            self.serving = serving
            response = health_pb2.HealthCheckResponse
            status = response.SERVING if serving else response.NOT_SERVING
            self._health_update = asyncio.ensure_future(self.health.set("", status))

    def model_info(self) -> api_pb2.ModelInfo:
        if self.info is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        return api_pb2.ModelInfo(
            model=self.model_id,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            eos_token_ids=self.info.eos_token_ids,
            instance_id=self.config.instance_id,
            num_replicas=len(self.router.replicas),
            num_replicas_ready=self.router.num_healthy,
        )

    def validate(self, request: api_pb2.GenerateRequest) -> ValidRequest:
        """The request tokenized, with defaults filled; GatewayError INVALID_ARGUMENT (naming the
        field, value and limit) or UNAVAILABLE (no scheduler yet) otherwise."""
        if self.limits is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        try:
            return validate(request, self.tokenizer, self.limits)
        except ValidationError as err:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err

    async def generate(
        self, valid: ValidRequest, request_id: str, trace: RequestTelemetry
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Submit valid to a scheduler replica (the router's pick; others if it fails before
        its first token) and stream its text. The last message carries the finish reason and
        usage. Raises GatewayError with the scheduler's code when every replica refuses
        (RESOURCE_EXHAUSTED: queue full) or when the request is lost after its first token
        (UNAVAILABLE). Ends trace."""
        submit = scheduler_pb2.SubmitRequest()
        submit.CopyFrom(valid.submit)
        submit.request_id = request_id
        messages = self._routed_messages(submit, (*self.peer_metadata, *trace.metadata()))
        try:
            async for msg in self._stream(request_id, valid, messages):
                trace.on_response(msg)
                if msg.finish_reason:
                    trace.finish(msg.finish_reason)
                yield msg
        except grpc.aio.AioRpcError as err:
            trace.finish(code=err.code().name, message=err.details() or "")
            raise GatewayError(err.code(), err.details() or err.code().name) from err
        except GatewayError as err:
            trace.finish(code=err.code.name, message=err.message)
            raise
        finally:
            await messages.aclose()  # cancels the Submit call: the scheduler frees the request
            trace.finish(code="CANCELLED", message="client went away")  # no-op when finished

    async def _routed_messages(
        self, submit: scheduler_pb2.SubmitRequest, metadata: tuple[tuple[str, str], ...]
    ) -> AsyncGenerator[scheduler_pb2.SubmitResponse, None]:
        """submit's messages from the replica the router picks. Until the first message, a
        replica that refuses (UNAVAILABLE, RESOURCE_EXHAUSTED), ends the request (ABORT) or is
        lost is left for another, each tried once; the last refusal's code when none is left."""
        tried: set[str] = set()
        refusal: RetryElsewhere | None = None
        while True:
            replica = self.router.route(submit.prompt_token_ids, tried)
            if replica is None:
                raise _no_replica(refusal, len(self.router.replicas))
            tried.add(replica.address)
            link = self.links[replica.address]
            attempt = Attempt(link.stub.Submit(submit, metadata=metadata))
            link.attempts.add(attempt)
            try:
                async for msg in _attempt_messages(attempt):
                    yield msg
                return
            except RetryElsewhere as err:
                refusal = err
                log.info(
                    "trying another replica",
                    request_id=submit.request_id,
                    address=replica.address,
                    why=err.message,
                )
            finally:
                link.attempts.discard(attempt)
                attempt.call.cancel()
                self.router.done(replica)

    async def _stream(
        self,
        request_id: str,
        valid: ValidRequest,
        messages: AsyncIterator[scheduler_pb2.SubmitResponse],
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer, valid.prompt_token_ids)
        stops = StopStringMatcher(valid.stop)
        out = api_pb2.GenerateResponse(request_id=request_id)
        usage = api_pb2.Usage(prompt_tokens=len(valid.prompt_token_ids))
        async for msg in messages:
            if msg.finish_reason == common_pb2.FINISH_REASON_ABORT:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, SERVER_ENDED_MESSAGE)
            if msg.num_prompt_tokens:
                usage.cached_prompt_tokens = msg.num_cached_tokens
            out.token_ids.extend(msg.token_ids)
            out.logprobs.extend(msg.logprobs)
            out.top_logprobs.extend(msg.top_logprobs)
            usage.completion_tokens += len(msg.token_ids)
            text, hit = stops.feed(detok.add(list(msg.token_ids)))
            if not hit and msg.finish_reason:
                tail, hit = stops.feed(detok.flush())
                text += tail if hit else tail + stops.flush()
            finish = common_pb2.FINISH_REASON_STOP if hit else msg.finish_reason
            if not (text or finish):
                continue  # everything held back (partial character or possible stop string)
            out.text = text
            if finish:
                out.finish_reason = finish
                out.usage.CopyFrom(usage)
                yield out
                return
            yield out
            out = api_pb2.GenerateResponse(request_id=request_id)
        raise GatewayError(
            grpc.StatusCode.INTERNAL, "scheduler ended the stream without a finish reason"
        )

    async def close(self) -> None:
        for link in list(self.links.values()):
            await self._close_link(link)
        self.links.clear()


class RetryElsewhere(Exception):
    """A replica refused or lost a request before its first token: another may take it."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _no_replica(refusal: RetryElsewhere | None, num_replicas: int) -> GatewayError:
    """The error for a request no replica took: the last refusal's, else UNAVAILABLE."""
    if refusal is not None:
        return GatewayError(refusal.code, refusal.message)
    return GatewayError(
        grpc.StatusCode.UNAVAILABLE,
        f"no scheduler is serving (0 of {num_replicas} replicas ready); retry shortly",
    )


async def _attempt_messages(attempt: Attempt) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
    """attempt's messages. Before the first: RetryElsewhere on a refusal another replica may
    not share (UNAVAILABLE, RESOURCE_EXHAUSTED), an ABORT or a lost replica. After it: losing
    the replica (it died, its connection did, or it stopped answering) is GatewayError
    UNAVAILABLE saying so. Other errors pass through."""
    received = False
    try:
        async for msg in attempt.call:
            if not received and msg.finish_reason == common_pb2.FINISH_REASON_ABORT:
                raise RetryElsewhere(grpc.StatusCode.UNAVAILABLE, SERVER_ENDED_MESSAGE)
            received = True
            yield msg
    except grpc.aio.AioRpcError as err:
        code, details = err.code(), err.details() or err.code().name
        if not received and code in RETRYABLE:
            raise RetryElsewhere(code, details) from err
        if code != grpc.StatusCode.UNAVAILABLE:
            raise
        raise GatewayError(code, f"lost the scheduler mid-request ({details}); retry") from err
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not attempt.lost or (task is not None and task.cancelling()):
            raise  # the client went away
        if not received:
            raise RetryElsewhere(grpc.StatusCode.UNAVAILABLE, REPLICA_SILENT_MESSAGE) from None
        raise GatewayError(
            grpc.StatusCode.UNAVAILABLE,
            f"lost the scheduler mid-request ({REPLICA_SILENT_MESSAGE}); retry",
        ) from None


def _load(stats: scheduler_pb2.SchedulerStats) -> ReplicaLoad:
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


class ReplicaMismatch(Exception):
    """A replica serves something else than the first one did (model, limits, block size)."""
