"""A fake scheduler that speaks the real Scheduler gRPC contract (protos/scheduler.proto), with
the operator RPCs (ListRequests, AbortRequest, Drain), and a gateway run in-process on a thread
of its own in front of it: the gateway's admission, quotas and Admin service tested without an
engine or a real scheduler.

Each request echoes its prompt's token ids, one per step of step_s seconds, for max_tokens
tokens (finish reason LENGTH). While `gate` is clear no request makes progress: requests stay in
flight for as long as a test wants.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from llmserve.common.net import CHANNEL_OPTIONS, check_health
from llmserve.gateway.config import GatewayConfig
from llmserve.protos import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.factories import EOS_TOKEN_ID, TINY_VOCAB

BLOCK_SIZE = 16
NUM_BLOCKS = 64


@dataclass(eq=False)
class FakeRequest:
    submit: scheduler_pb2.SubmitRequest
    start: float
    num_output_tokens: int = 0
    aborted: bool = False

    def state(self) -> scheduler_pb2.RequestState:
        s = self.submit
        num_tokens = len(s.prompt_token_ids) + self.num_output_tokens
        return scheduler_pb2.RequestState(
            request_id=s.request_id,
            tenant=s.tenant,
            state="running" if self.num_output_tokens else "waiting",
            priority=s.priority,
            num_prompt_tokens=len(s.prompt_token_ids),
            num_output_tokens=self.num_output_tokens,
            num_computed_tokens=num_tokens - 1 if self.num_output_tokens else 0,
            num_blocks=-(-num_tokens // BLOCK_SIZE) if self.num_output_tokens else 0,
            age_s=time.monotonic() - self.start,
        )


@dataclass(eq=False)
class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """operator_rpcs=False: ListRequests, AbortRequest and Drain answer UNIMPLEMENTED (a
    scheduler from before they existed)."""

    step_s: float = 0.005
    operator_rpcs: bool = True
    gate: threading.Event = field(default_factory=threading.Event)
    requests: dict[str, FakeRequest] = field(default_factory=dict)
    submitted: list[scheduler_pb2.SubmitRequest] = field(default_factory=list)
    draining: bool = False
    num_steps: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.gate.set()

    def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.ServicerContext
    ) -> Iterator[scheduler_pb2.SubmitResponse]:
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the scheduler is draining")
        req = FakeRequest(request, time.monotonic())
        with self.lock:
            self.submitted.append(request)
            self.requests[request.request_id] = req
        try:
            prompt = list(request.prompt_token_ids)
            for i in range(request.max_tokens):
                while not self.gate.wait(0.01):
                    if req.aborted or not context.is_active():
                        break
                if req.aborted:
                    yield scheduler_pb2.SubmitResponse(finish_reason=common_pb2.FINISH_REASON_ABORT)
                    return
                if not context.is_active():
                    return
                time.sleep(self.step_s)
                with self.lock:
                    self.num_steps += 1
                    req.num_output_tokens += 1
                last = i == request.max_tokens - 1
                msg = scheduler_pb2.SubmitResponse(
                    token_ids=[prompt[i % len(prompt)]],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH
                    if last
                    else common_pb2.FINISH_REASON_UNSPECIFIED,
                )
                if i == 0:
                    msg.num_prompt_tokens = len(prompt)
                yield msg
        finally:
            with self.lock:
                self.requests.pop(request.request_id, None)

    def GetInfo(
        self, request: scheduler_pb2.GetInfoRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SchedulerInfo:
        return scheduler_pb2.SchedulerInfo(
            model="fake-echo", max_model_len=512, vocab_size=TINY_VOCAB,
            eos_token_ids=[EOS_TOKEN_ID], block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
            max_num_seqs=16, max_num_batched_tokens=512, max_waiting=64,
        )  # fmt: skip

    def stats(self) -> scheduler_pb2.SchedulerStats:
        with self.lock:
            states = [r.state() for r in self.requests.values()]
            tenants: dict[str, scheduler_pb2.TenantStats] = {}
            for r, s in zip(self.requests.values(), states, strict=True):
                t = tenants.setdefault(
                    s.tenant,
                    scheduler_pb2.TenantStats(tenant=s.tenant, weight=r.submit.tenant_weight),
                )
                t.num_running += s.state == "running"
                t.num_waiting += s.state == "waiting"
                t.num_blocks += s.num_blocks
            used = sum(s.num_blocks for s in states)
            return scheduler_pb2.SchedulerStats(
                num_steps=self.num_steps,
                num_running=sum(s.state == "running" for s in states),
                num_waiting=sum(s.state == "waiting" for s in states),
                num_blocks=NUM_BLOCKS,
                num_free_blocks=NUM_BLOCKS - used,
                ready=True,
                draining=self.draining,
                tenants=list(tenants.values()),
            )

    def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return self.stats()

    def WatchStats(
        self, request: scheduler_pb2.WatchStatsRequest, context: grpc.ServicerContext
    ) -> Iterator[scheduler_pb2.SchedulerStats]:
        while context.is_active():
            yield self.stats()
            time.sleep((request.interval_ms or 250) / 1000)

    def _operator(self, context: grpc.ServicerContext) -> None:
        if not self.operator_rpcs:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")

    def ListRequests(
        self, request: scheduler_pb2.ListRequestsRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.ListRequestsResponse:
        self._operator(context)
        with self.lock:
            states = [r.state() for r in self.requests.values()]
        wanted = [s for s in states if not request.tenant or s.tenant == request.tenant]
        return scheduler_pb2.ListRequestsResponse(requests=wanted)

    def AbortRequest(
        self, request: scheduler_pb2.AbortRequestRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.AbortRequestResponse:
        self._operator(context)
        with self.lock:
            req = self.requests.get(request.request_id)
            found = req is not None and not req.aborted
            if req is not None:
                req.aborted = True
        return scheduler_pb2.AbortRequestResponse(num_aborted=int(found))

    def Drain(
        self, request: scheduler_pb2.DrainRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.DrainResponse:
        self._operator(context)
        self.draining = not request.resume
        return scheduler_pb2.DrainResponse(draining=self.draining)


def start_fake_scheduler(scheduler: FakeScheduler) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


class GatewayThread:
    """The gateway's gRPC server (Generation, Admin, health) and, with http, its HTTP API, on an
    event loop of their own thread; `core` is the running GatewayCore."""

    def __init__(self, config: GatewayConfig, http: bool = False):
        from llmserve.topology import free_port

        if http:
            config = replace(config, http_port=free_port())
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._tasks: list[asyncio.Future[Any]] = []
        self.http_url = f"http://127.0.0.1:{config.http_port}" if http else None
        self.core, self.server, self.http_server, port = self.call(self._start())
        self.address = f"127.0.0.1:{port}"

    def call(self, coroutine: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start(self) -> tuple[Any, grpc.aio.Server, Any, int]:
        from llmserve.common.model_config import resolve_model_path
        from llmserve.common.net import listen
        from llmserve.gateway.core import GatewayCore
        from llmserve.gateway.service import make_server, set_initial_health
        from llmserve.gateway.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_model_path(resolve_model_path(self.config.model))
        core = GatewayCore(self.config, tokenizer)
        server = make_server(core)
        await set_initial_health(core)
        port = listen(server, "gateway", "127.0.0.1", 0, None)
        await server.start()
        self._tasks.append(asyncio.ensure_future(core.replicas.watch_scheduler()))
        http = None
        if self.config.http_port:
            from llmserve.gateway.http import HttpServer, create_app

            http = HttpServer(create_app(core), "127.0.0.1", self.config.http_port)
            self._tasks.append(asyncio.ensure_future(http.serve()))
        return core, server, http, port

    def wait_serving(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while check_health(self.address, timeout=1.0) != "SERVING":
            assert time.monotonic() < deadline, "the gateway never became SERVING"
            time.sleep(0.02)

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)

    async def _stop(self) -> None:
        if self.http_server is not None:
            await self.http_server.shutdown()
        await self.server.stop(grace=0.5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.core.replicas.close()

    def close(self) -> None:
        try:
            self.call(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


def gateway_config(tokenizer_dir: Path, scheduler_addresses: list[str], **fields: Any) -> Any:
    return GatewayConfig(
        model=str(tokenizer_dir),
        scheduler_address=tuple(scheduler_addresses),
        served_model_name=("fake-echo",),
        port=0,
        http_port=0,
        metrics_port=0,
        **fields,
    )
