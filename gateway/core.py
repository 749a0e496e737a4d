"""The request path both APIs share, the gRPC Generation service and the OpenAI-compatible HTTP
API, in front of the same scheduler connection:

    validate -> submit to the scheduler -> detokenize + stop strings -> stream text

Each phase is one method. Closing or cancelling a `generate` stream (its client went away) cancels
the Submit call upstream: the scheduler then aborts the request and frees its blocks before its
next step. A stop string ends the request the same way, after the text before it has been sent.

A request the server ends itself (the scheduler's finish reason ABORT: it is shutting down, or its
engine came back too small to hold the request) and one whose scheduler was lost mid-stream are
UNAVAILABLE errors, which a client can retry, never a finish reason. So is one an operator aborts
(Admin.AbortRequest, or a Drain that timed out): it is never retried on another replica.

Before any of that, `admit` names the request's tenant (gateway/tenants.py) and holds it to the
tenant's quotas (gateway/quotas.py); a draining gateway admits nothing.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2

from common.choice_id import names_request
from common.log import get_logger
from common.model_config import default_model_id
from gateway.config import DNS_PREFIX, GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.quotas import Admission, QuotaExceeded, Quotas, TooLarge
from gateway.router import Replica, ReplicaLoad, Router
from gateway.stop import StopStringMatcher
from gateway.telemetry import GatewayTelemetry, RequestTelemetry
from gateway.tenants import DEFAULT_TENANT, Caller, TenantError, TenantTable
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
DRAINING_MESSAGE = "this gateway is draining (an operator's Drain) and admits nothing; retry"
STATS_WINDOW_S = 5.0  # steps per second are measured over this much of the stats stream


class GatewayError(Exception):
    """A request refused or failed. `code` is the gRPC status (the design's failure vocabulary);
    the HTTP API maps it to an HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # over a quota: when a retry can succeed


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(eq=False)
class Attempt:
    """One Submit call of a request to one replica. lost: the replica was declared lost while
    it ran (its call was cancelled by us, not by the client)."""

    call: grpc.aio.UnaryStreamCall
    lost: bool = False
    aborted: str | None = None  # an operator aborted the request: why


@dataclass(eq=False)
class InFlight:
    """A scheduler request (one choice) this gateway streams now."""

    request_id: str
    tenant: str
    num_prompt_tokens: int
    start: float  # monotonic
    num_output_tokens: int = 0
    started: bool = False  # a scheduler took it (it sent a message)
    replica: str = ""  # the address of the replica of its current attempt
    attempt: Attempt | None = None
    aborted: str | None = None

    @property
    def num_consumed_tokens(self) -> int:
        """What it costs its tenant's tokens-per-minute quota: nothing unless a scheduler took
        it; then its prompt and what it generated."""
        return self.num_prompt_tokens * self.started + self.num_output_tokens

    def abort(self, why: str) -> None:
        """End the request with UNAVAILABLE why: its Submit call is cancelled (the scheduler
        frees it) and it is not tried elsewhere."""
        self.aborted = why
        if self.attempt is not None:
            self.attempt.aborted = why
            self.attempt.call.cancel()


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
    def steps_per_s(self) -> float:
        if len(self.steps) < 2 or self.steps[-1][0] <= self.steps[0][0]:
            return 0.0
        (t0, n0), (t1, n1) = self.steps[0], self.steps[-1]
        return max(0, n1 - n0) / (t1 - t0)


class GatewayCore:
    def __init__(
        self, config: GatewayConfig, tokenizer: Tokenizer, tenants: TenantTable | None = None
    ):
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
        self.tenants = tenants or load_tenants(config)
        self.quotas = Quotas(self.tenants)
        self.in_flight: set[InFlight] = set()
        self.draining = False

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
                link.on_stats(stats, time.monotonic())
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

    # -- tenants and admission ---------------------------------------------------------------------

    def caller(self, authorization: str | None, user: str) -> Caller:
        """Who sent a request: its key's tenant, else (no keys configured) its `user` field's.
        GatewayError INVALID_ARGUMENT for a `user` that cannot name a tenant."""
        try:
            return self.tenants.resolve(authorization, user)
        except TenantError as err:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err

    def admit(self, caller: Caller, valids: list[ValidRequest], n: int = 1) -> Admission:
        """Hold caller's tenant to its quotas for valids, n sequences each (release the
        admission when they end). GatewayError: UNAVAILABLE while draining; RESOURCE_EXHAUSTED
        with retry_after_s over a quota now; INVALID_ARGUMENT for what no quota could ever
        admit. Each refusal is counted by tenant and reason."""
        if self.draining:
            self.telemetry.refused(caller.tenant, "draining")
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        costs = [len(v.prompt_token_ids) + v.submit.max_tokens for v in valids for _ in range(n)]
        try:
            return self.quotas.admit(caller.tenant, costs)
        except QuotaExceeded as err:
            self.telemetry.refused(err.tenant, err.reason)
            raise GatewayError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, err.message, err.retry_after_s
            ) from err
        except TooLarge as err:
            self.telemetry.refused(err.tenant, "too_large")
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, err.message) from err

    def find_in_flight(self, request_id: str) -> list[InFlight]:
        """The requests in flight request_id names: the one of that id, or the choices of an
        HTTP request (named by its response id: its choices are RESPONSE_ID-INDEX)."""
        return [e for e in self.in_flight if names_request(request_id, e.request_id)]

    @property
    def num_admitted(self) -> int:
        """Sequences admitted and not yet ended (an HTTP request's choices count before their
        Submit calls start)."""
        return sum(usage.num_in_flight for usage in self.quotas.usage.values())

    def set_draining(self, draining: bool) -> None:
        """Stop (or restart) admitting; readiness follows (NOT_SERVING while draining)."""
        self.draining = draining
        self._update_health()

    # -- the request path --------------------------------------------------------------------------

    async def generate(
        self,
        valid: ValidRequest,
        request_id: str,
        trace: RequestTelemetry,
        admission: Admission | None = None,
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        """Submit valid to a scheduler replica (the router's pick; others if it fails before
        its first token) and stream its text. The last message carries the finish reason and
        usage. Raises GatewayError with the scheduler's code when every replica refuses
        (RESOURCE_EXHAUSTED: queue full) or when the request is lost after its first token
        (UNAVAILABLE). Ends trace. The tokens it consumed (its prompt once a scheduler took it,
        and what it generated) are counted on admission, which the caller releases."""
        submit = scheduler_pb2.SubmitRequest()
        submit.CopyFrom(valid.submit)
        submit.request_id = request_id
        submit.tenant = admission.tenant if admission is not None else DEFAULT_TENANT
        submit.tenant_weight = self.tenants.limits(submit.tenant).weight
        entry = InFlight(request_id, submit.tenant, len(submit.prompt_token_ids), time.monotonic())
        self.in_flight.add(entry)
        metadata = (*self.peer_metadata, *trace.metadata())
        messages = self._routed_messages(submit, metadata, entry)
        try:
            async for msg in self._stream(request_id, valid, messages, entry):
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
            self.in_flight.discard(entry)
            if admission is not None:
                admission.use(entry.num_consumed_tokens)
            await messages.aclose()  # cancels the Submit call: the scheduler frees the request
            trace.finish(code="CANCELLED", message="client went away")  # no-op when finished

    async def _routed_messages(
        self,
        submit: scheduler_pb2.SubmitRequest,
        metadata: tuple[tuple[str, str], ...],
        entry: InFlight,
    ) -> AsyncGenerator[scheduler_pb2.SubmitResponse, None]:
        """submit's messages from the replica the router picks. Until the first message, a
        replica that refuses (UNAVAILABLE, RESOURCE_EXHAUSTED), ends the request (ABORT) or is
        lost is left for another, each tried once; the last refusal's code when none is left.
        A request an operator aborted (entry.aborted) is tried nowhere else."""
        tried: set[str] = set()
        refusal: RetryElsewhere | None = None
        while True:
            if entry.aborted:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, entry.aborted)
            replica = self.router.route(submit.prompt_token_ids, tried)
            if replica is None:
                raise _no_replica(refusal, len(self.router.replicas))
            tried.add(replica.address)
            link = self.links[replica.address]
            attempt = Attempt(link.stub.Submit(submit, metadata=metadata))
            link.attempts.add(attempt)
            entry.attempt, entry.replica = attempt, replica.address
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
                entry.attempt = None
                link.attempts.discard(attempt)
                attempt.call.cancel()
                self.router.done(replica)

    async def _stream(
        self,
        request_id: str,
        valid: ValidRequest,
        messages: AsyncIterator[scheduler_pb2.SubmitResponse],
        entry: InFlight,
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer, valid.prompt_token_ids)
        stops = StopStringMatcher(valid.stop)
        out = api_pb2.GenerateResponse(request_id=request_id)
        usage = api_pb2.Usage(prompt_tokens=len(valid.prompt_token_ids))
        async for msg in messages:
            entry.started = True
            if msg.finish_reason == common_pb2.FINISH_REASON_ABORT:
                why = entry.aborted or SERVER_ENDED_MESSAGE
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, why)
            entry.num_output_tokens += len(msg.token_ids)
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
        if code == grpc.StatusCode.CANCELLED and (attempt.aborted or attempt.lost):
            # This gateway cancelled the call (the replica was lost, or an operator aborted):
            # the cancellation surfaces as the call's status as often as a CancelledError.
            raise _cancelled_here(attempt, received) from None
        if not received and code in RETRYABLE:
            raise RetryElsewhere(code, details) from err
        if code != grpc.StatusCode.UNAVAILABLE:
            raise
        raise GatewayError(code, f"lost the scheduler mid-request ({details}); retry") from err
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the client went away
        if not (attempt.aborted or attempt.lost):
            raise  # the client went away
        raise _cancelled_here(attempt, received) from None


def _cancelled_here(attempt: Attempt, received: bool) -> GatewayError | RetryElsewhere:
    """What ends an attempt this gateway cancelled: an operator's abort is final; a lost
    replica is retried elsewhere before the first token, UNAVAILABLE after it."""
    if attempt.aborted:
        return GatewayError(grpc.StatusCode.UNAVAILABLE, attempt.aborted)
    if not received:
        return RetryElsewhere(grpc.StatusCode.UNAVAILABLE, REPLICA_SILENT_MESSAGE)
    return GatewayError(
        grpc.StatusCode.UNAVAILABLE,
        f"lost the scheduler mid-request ({REPLICA_SILENT_MESSAGE}); retry",
    )


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


def load_tenants(config: GatewayConfig) -> TenantTable:
    """The gateway's tenant table: --api-keys FILE (with --api-key as one more key, the default
    tenant's) or just --api-key. ValueError (TenantError) naming the field when the file is
    wrong, or when the admin key is also a client key."""
    api_key = config.api_key
    if config.api_keys:
        table = TenantTable.load(config.api_keys, api_key)
    else:
        table = TenantTable.single_key(api_key)
    try:
        admin = config.admin_secret()
    except OSError as err:
        raise TenantError(f"admin_key={config.admin_key!r} cannot be read: {err.strerror}") from err
    if admin is not None and table.find_key(f"Bearer {admin}") is not None:
        raise TenantError("admin_key is also a client key: a client key must not open Admin")
    return table
