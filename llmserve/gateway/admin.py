"""The operator's Admin service (protos/admin.proto) on the gateway's gRPC port, behind the admin
key (gateway/service.py checks it). It acts on this gateway (draining, the tenant table) and
forwards to every scheduler replica it knows (ListRequests, AbortRequest, Drain); capacity and
health come from the stats each scheduler streams to the gateway anyway (gateway/replicas.py).

A replica that cannot answer a forwarded call (down, or a scheduler without the operator RPCs:
UNIMPLEMENTED) does not fail the call: ListRequests shows what this gateway knows of the requests
it streams from that replica, AbortRequest cancels this gateway's own Submit calls, Drain stops
this gateway admitting either way. Every call is logged with its method, the caller's address,
the key's name ("admin") and its arguments.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from llmserve.common.log import get_logger
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.replicas import ReplicaLink
from llmserve.gateway.streaming import InFlight
from llmserve.gateway.tenants import TenantError, TenantLimits, tenant_name
from llmserve.protos import admin_pb2, admin_pb2_grpc, scheduler_pb2

log = get_logger("llmserve.gateway.admin")

DRAIN_PROGRESS_S = 0.25  # how often Drain reports
REPLICA_TIMEOUT_S = 5.0  # a forwarded call's deadline
ABORTED_MESSAGE = "aborted by an operator (Admin.AbortRequest)"


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, core: GatewayCore):
        self.core = core

    # -- drain ---------------------------------------------------------------------------------

    async def Drain(
        self, request: admin_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.DrainProgress]:
        """Stop admitting here and at every scheduler; report the requests this gateway still
        streams every DRAIN_PROGRESS_S until none is left; past timeout_s (0: never), abort
        them. The last message has done set. Cancelling the call leaves the gateway draining."""
        _logged(context, "Drain", request)
        timeout = request.timeout_s
        if not math.isfinite(timeout) or timeout < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s={timeout} must be >= 0 (0: none)"
            )
        self.core.replicas.set_draining(True)
        await self._drain_replicas(resume=False)
        start = time.monotonic()
        num_aborted = 0
        while num_in_flight := self.core.num_admitted:
            elapsed = time.monotonic() - start
            if timeout and elapsed >= timeout:
                why = f"aborted: the gateway drained and timeout_s={timeout:g} passed; retry"
                num_aborted += _abort([e for e in self.core.in_flight if not e.aborted], why)
            yield admin_pb2.DrainProgress(num_in_flight=num_in_flight, elapsed_s=elapsed)
            await asyncio.sleep(DRAIN_PROGRESS_S)
        log.info("drained", num_aborted=num_aborted)
        yield admin_pb2.DrainProgress(
            num_aborted=num_aborted, elapsed_s=time.monotonic() - start, done=True
        )

    async def Resume(
        self, request: admin_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ResumeResponse:
        _logged(context, "Resume", request)
        self.core.replicas.set_draining(False)
        await self._drain_replicas(resume=True)
        return admin_pb2.ResumeResponse()

    async def _drain_replicas(self, resume: bool) -> None:
        answers = await self._ask_replicas("Drain", scheduler_pb2.DrainRequest(resume=resume))
        for address, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning(
                    "a scheduler did not take Drain", address=address, resume=resume,
                    error=_why(answer),
                )  # fmt: skip

    # -- requests --------------------------------------------------------------------------------

    async def ListRequests(
        self, request: admin_pb2.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListRequestsResponse:
        """Every replica's requests (of request.tenant, when set), in replica order; for a
        replica that cannot answer, the requests this gateway streams from it."""
        _logged(context, "ListRequests", request)
        # "default" names the default tenant (""), which the schedulers read as "all": the
        # gateway filters their answers itself.
        tenant = await self._tenant(request.tenant, context) if request.tenant else None
        forwarded = scheduler_pb2.ListRequestsRequest(tenant=tenant or "")
        answers = await self._ask_replicas("ListRequests", forwarded)
        out = admin_pb2.ListRequestsResponse()
        for address, answer in answers.items():
            if isinstance(answer, BaseException):
                states = [_gateway_view(e) for e in self.core.in_flight if e.replica == address]
            else:
                states = list(answer.requests)
            states = [s for s in states if tenant is None or s.tenant == tenant]
            out.requests.extend(
                admin_pb2.ListRequestsResponse.Entry(replica=address, request=s) for s in states
            )
        return out

    async def AbortRequest(
        self, request: admin_pb2.AbortRequestRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AbortRequestResponse:
        """Ask every replica to abort request_id (or, for an HTTP response id, each of its
        choices); if none did, cancel this gateway's own calls of it. NOT_FOUND when nobody
        holds it. Its client gets UNAVAILABLE, and it is not retried elsewhere."""
        _logged(context, "AbortRequest", request)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        local = [e for e in self.core.find_in_flight(request.request_id) if not e.aborted]
        for entry in local:
            entry.aborted = ABORTED_MESSAGE  # its ABORT is then not retried elsewhere
        ids = [e.request_id for e in local] or [request.request_id]
        num_aborted = 0
        for request_id in ids:
            forwarded = scheduler_pb2.AbortRequestRequest(request_id=request_id)
            answers = await self._ask_replicas("AbortRequest", forwarded)
            num_aborted += sum(
                a.num_aborted for a in answers.values() if not isinstance(a, BaseException)
            )
        if num_aborted == 0:
            num_aborted = _abort(local, ABORTED_MESSAGE)
        if num_aborted == 0:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"request_id={request.request_id!r} is not running or waiting on any replica",
            )
        return admin_pb2.AbortRequestResponse(num_aborted=num_aborted)

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def LoadLora(
        self, request: scheduler_pb2.LoadLoraRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.LoadLoraResponse:
        """Load an adapter on every replica (each engine checks it); the first refusal's code
        and message when any refuses (the others may serve it meanwhile: loading again is
        safe)."""
        _logged(context, "LoadLora", request)
        if not request.lora_name or not request.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora_name and path are needed")
        if request.lora_name in self.core.model_names:  # it would shadow the base model
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"lora_name={request.lora_name!r} is the base model's id: name the adapter "
                "otherwise",
            )
        answers = await self._ask_replicas("LoadLora", request)
        loaded = await self._first_answer(answers, context)
        await self._until_served(request.lora_name, True)
        return loaded

    async def UnloadLora(
        self, request: scheduler_pb2.UnloadLoraRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.UnloadLoraResponse:
        """Unload an adapter on every replica: new requests for it get NOT_FOUND, those
        admitted keep it until they end (num_requests_using, summed)."""
        _logged(context, "UnloadLora", request)
        answers = await self._ask_replicas("UnloadLora", request)
        done = [a for a in answers.values() if not isinstance(a, BaseException)]
        if not done:
            await self._first_answer(answers, context)
        await self._until_served(request.lora_name, False)
        return scheduler_pb2.UnloadLoraResponse(
            num_requests_using=sum(a.num_requests_using for a in done)
        )

    async def _until_served(self, name: str, served: bool) -> None:
        """Wait (a few stats periods at most) until this gateway's view of its replicas' adapters
        (their stats) agrees, so that a request sent after the call sees the change."""
        deadline = time.monotonic() + REPLICA_TIMEOUT_S
        while (name in self.core.lora_names) != served and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def _first_answer(
        self, answers: dict[str, Any], context: grpc.aio.ServicerContext
    ) -> Any:
        """The first answer when every replica answered; else abort with the first error's code
        and message."""
        for answer in answers.values():
            if isinstance(answer, grpc.aio.AioRpcError):
                await context.abort(answer.code(), answer.details() or answer.code().name)
            if isinstance(answer, BaseException):
                await context.abort(grpc.StatusCode.INTERNAL, _why(answer))
        if not answers:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler replica")
        return next(iter(answers.values()))

    # -- capacity and health ----------------------------------------------------------------------

    async def GetCapacity(
        self, request: admin_pb2.GetCapacityRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Capacity:
        """Each replica from the last stats its scheduler streamed (zeros for one not heard
        from), and their sums. steps_per_s: over the last STATS_WINDOW_S of its stats."""
        _logged(context, "GetCapacity", request)
        out = admin_pb2.Capacity()
        for address, link in list(self.core.replicas.links.items()):
            out.replicas.append(self._replica_capacity(address, link))
        for name in ("num_blocks", "num_free_blocks", "num_running", "num_waiting", "steps_per_s"):
            setattr(out, name, sum(getattr(r, name) for r in out.replicas))
        return out

    def _replica_capacity(self, address: str, link: ReplicaLink) -> admin_pb2.ReplicaCapacity:
        replica = self.core.replicas.router.replicas.get(address)
        out = admin_pb2.ReplicaCapacity(
            replica=address, ready=replica is not None and replica.healthy
        )
        stats = link.stats
        if stats is None:
            return out
        out.draining = stats.draining
        out.num_blocks = stats.num_blocks
        out.num_free_blocks = stats.num_free_blocks
        out.num_running = stats.num_running
        out.num_waiting = stats.num_waiting
        out.steps_per_s = link.steps_per_s
        out.tenants.extend(stats.tenants)
        return out

    async def GetHealth(
        self, request: admin_pb2.GetHealthRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.Health:
        """This gateway (healthy: admitting, and some replica ready), then each scheduler
        (healthy: its stats stream is alive) and its engine (healthy: the scheduler reports
        itself ready, which it is while its engine answers); under disaggregation, each of the
        scheduler's engines too (from its stats' `engines` rows)."""
        _logged(context, "GetHealth", request)
        core = self.core
        num_ready, num = core.replicas.router.num_healthy, len(core.replicas.router.replicas)
        gateway_detail = f"{num_ready} of {num} replicas ready"
        if core.replicas.draining:
            gateway_detail = f"draining, {core.num_admitted} in flight; {gateway_detail}"
        out = admin_pb2.Health()
        out.components.add(
            component="gateway",
            healthy=not core.replicas.draining and num_ready > 0,
            detail=gateway_detail,
        )
        for address, replica in core.replicas.router.replicas.items():
            link = core.replicas.links.get(address)
            draining = link is not None and link.stats is not None and link.stats.draining
            out.components.add(
                component=f"scheduler {address}",
                healthy=replica.reachable,
                detail=("draining" if draining else "streaming its stats")
                if replica.reachable
                else "unreachable: its stats stream is down or silent",
            )
            out.components.add(
                component=f"engine of {address}",
                healthy=replica.healthy,
                detail="ready"
                if replica.healthy
                else "not ready (its scheduler has no engine answering)"
                if replica.reachable
                else "unknown: its scheduler is unreachable",
            )
            # Disaggregated: each prefill and decode engine the scheduler drives, as it last
            # reported them.
            for row in link.stats.engines if link is not None and link.stats is not None else []:
                out.components.add(
                    component=f"{row.role} engine {row.address} of {address}",
                    healthy=row.ready,
                    detail=f"ready, {row.num_running} running, {row.num_waiting} waiting"
                    if row.ready
                    else "down: its requests moved to the other engines",
                )
        return out

    # -- tenants ----------------------------------------------------------------------------------

    async def SetTenantWeight(
        self, request: admin_pb2.SetTenantWeightRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TenantConfig:
        """Requests submitted from now on carry the new weight."""
        _logged(context, "SetTenantWeight", request)
        tenant = await self._tenant(request.tenant, context)
        try:
            self.core.tenants.set_weight(tenant, request.weight)
        except TenantError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return self._config(tenant)

    async def SetQuota(
        self, request: admin_pb2.SetQuotaRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.TenantConfig:
        """Applies at the next admission; a tokens-per-minute bucket keeps its level (clamped
        to a lower limit; full when there was no limit)."""
        _logged(context, "SetQuota", request)
        tenant = await self._tenant(request.tenant, context)
        tpm = request.tokens_per_minute if request.HasField("tokens_per_minute") else None
        concurrent = (
            request.max_concurrent_requests if request.HasField("max_concurrent_requests") else None
        )
        try:
            self.core.tenants.set_quota(tenant, tpm, concurrent)
        except TenantError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return self._config(tenant)

    async def ListTenants(
        self, request: admin_pb2.ListTenantsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListTenantsResponse:
        """The default tenant, the listed ones, then every other tenant a scheduler reports or
        this gateway has state for (each with the default's limits)."""
        _logged(context, "ListTenants", request)
        core = self.core
        names = ["", *sorted(core.tenants.tenants)]
        seen = {
            t.tenant
            for link in core.replicas.links.values()
            if link.stats
            for t in link.stats.tenants
        }
        names += sorted((seen | set(core.quotas.usage)) - set(names))
        return admin_pb2.ListTenantsResponse(tenants=[self._config(name) for name in names])

    def _config(self, tenant: str) -> admin_pb2.TenantConfig:
        limits: TenantLimits = self.core.tenants.limits(tenant)
        return admin_pb2.TenantConfig(
            tenant=tenant,
            weight=limits.weight,
            tokens_per_minute=limits.tokens_per_minute,
            max_concurrent_requests=limits.max_concurrent_requests,
            num_in_flight=self.core.quotas.num_in_flight(tenant),
        )

    async def _tenant(self, value: str, context: grpc.aio.ServicerContext) -> str:
        try:
            return tenant_name(value)
        except TenantError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            raise  # not reached: abort raises

    # -- forwarding --------------------------------------------------------------------------------

    async def _ask_replicas(self, method: str, request: Message) -> dict[str, Any]:
        """Every replica's answer to method(request), or the exception it raised, by address."""
        links = list(self.core.replicas.links.values())

        async def ask(link: ReplicaLink) -> Any:
            call = getattr(link.stub, method)
            return await call(
                request, timeout=REPLICA_TIMEOUT_S, metadata=self.core.replicas.peer_metadata
            )

        answers = await asyncio.gather(*(ask(link) for link in links), return_exceptions=True)
        return {link.address: answer for link, answer in zip(links, answers, strict=True)}


def _logged(context: grpc.aio.ServicerContext, method: str, request: Message) -> None:
    arguments = MessageToDict(request, preserving_proto_field_name=True)
    log.info("admin call", method=method, peer=context.peer(), key="admin", arguments=arguments)


def _abort(entries: list[InFlight], why: str) -> int:
    """Cancel entries' Submit calls (each fails UNAVAILABLE why); how many there were."""
    for entry in entries:
        entry.abort(why)
    return len(entries)


def _gateway_view(entry: InFlight) -> scheduler_pb2.RequestState:
    """What this gateway knows of a request it streams (when its scheduler cannot say)."""
    return scheduler_pb2.RequestState(
        request_id=entry.request_id,
        tenant=entry.tenant,
        state="running" if entry.started else "waiting",
        num_prompt_tokens=entry.num_prompt_tokens,
        num_output_tokens=entry.num_output_tokens,
        age_s=time.monotonic() - entry.start,
    )


def _why(err: BaseException) -> str:
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return repr(err)
