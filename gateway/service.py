"""The gateway's gRPC service: validates, tokenizes, submits to the scheduler, and streams text.

A client's cancellation cancels the handler, whose `finally` cancels the Submit call upstream; the
scheduler then aborts the request and frees its blocks before its next step. A stop string ends the
request the same way, after the text before it has been sent.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop import StopStringMatcher
from gateway.tokenizer import Tokenizer
from gateway.validation import Limits, ValidationError, ValidRequest, validate
from llmserve.log import get_logger
from llmserve.model_config import resolve_model_path
from llmserve.net import CHANNEL_OPTIONS, SERVER_OPTIONS, serve_aio
from protos import api_pb2, api_pb2_grpc, common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = get_logger("gateway")


def submit_request(request_id: str, v: ValidRequest) -> scheduler_pb2.SubmitRequest:
    sampling = common_pb2.SamplingParams(
        temperature=v.temperature,
        top_k=v.top_k,
        top_p=v.top_p,
        min_p=v.min_p,
        logprobs=v.logprobs,
    )
    if v.seed is not None:
        sampling.seed = v.seed
    return scheduler_pb2.SubmitRequest(
        request_id=request_id,
        prompt_token_ids=v.prompt_token_ids,
        sampling=sampling,
        max_tokens=v.max_tokens,
        stop_token_ids=v.stop_token_ids,
        ignore_eos=v.ignore_eos,
    )


class GatewayService(api_pb2_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        self.channel = grpc.aio.insecure_channel(config.scheduler_address, options=CHANNEL_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.info: scheduler_pb2.SchedulerInfo | None = None
        self.limits: Limits | None = None
        self.health = health.aio.HealthServicer()

    async def watch_scheduler(self) -> None:
        """Learn the limits from the scheduler, then mirror its health in ours."""
        health_stub = health_pb2_grpc.HealthStub(self.channel)
        serving = None
        while True:
            try:
                if self.info is None:
                    self.info = await self.stub.GetInfo(scheduler_pb2.GetInfoRequest(), timeout=2)
                    self.limits = Limits(
                        max_model_len=self.info.max_model_len,
                        vocab_size=self.info.vocab_size,
                        kv_capacity_tokens=self.info.num_blocks * self.info.block_size,
                    )
                    log.info(
                        "scheduler connected",
                        model=self.info.model,
                        max_model_len=self.info.max_model_len,
                    )
                reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                status = reply.status
            except grpc.aio.AioRpcError:
                status = health_pb2.HealthCheckResponse.NOT_SERVING
            if status != serving:
                serving = status
                await self.health.set("", status)
            await asyncio.sleep(1.0)

    async def GetModelInfo(
        self, request: api_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> api_pb2.ModelInfo:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        assert self.info is not None
        return api_pb2.ModelInfo(
            model=self.info.model,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            eos_token_ids=self.info.eos_token_ids,
        )

    async def Generate(
        self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        if self.limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        assert self.limits is not None
        try:
            valid = validate(request, self.tokenizer, self.limits)
        except ValidationError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        call = self.stub.Submit(submit_request(request_id, valid))
        try:
            async for msg in self._stream(request_id, valid, call):
                yield msg
        except grpc.aio.AioRpcError as err:
            # The scheduler refused or lost the request: pass its code and message on.
            await context.abort(err.code(), err.details() or err.code().name)
        finally:
            call.cancel()

    async def _stream(
        self, request_id: str, valid: ValidRequest, call: grpc.aio.UnaryStreamCall
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer, valid.prompt_token_ids)
        stops = StopStringMatcher(valid.stop)
        ids: list[int] = []
        logprobs: list[float] = []
        usage = api_pb2.Usage(prompt_tokens=len(valid.prompt_token_ids))
        async for msg in call:
            if msg.num_prompt_tokens:
                usage.cached_prompt_tokens = msg.num_cached_tokens
            ids.extend(msg.token_ids)
            logprobs.extend(msg.logprobs)
            usage.completion_tokens += len(msg.token_ids)
            text, hit = stops.feed(detok.add(list(msg.token_ids)))
            finish = msg.finish_reason
            if hit:
                finish = common_pb2.FINISH_REASON_STOP
            elif finish:
                tail, hit = stops.feed(detok.flush())
                text += tail if hit else tail + stops.flush()
                if hit:
                    finish = common_pb2.FINISH_REASON_STOP
            if not (text or finish):
                continue  # everything held back (partial character or possible stop string)
            out = api_pb2.GenerateResponse(
                request_id=request_id, text=text, token_ids=ids, logprobs=logprobs
            )
            ids, logprobs = [], []
            if finish:
                out.finish_reason = finish
                out.usage.CopyFrom(usage)
                yield out
                return
            yield out
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.INTERNAL,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="scheduler ended the stream without a finish reason",
        )


async def serve(config: GatewayConfig) -> None:
    tokenizer = Tokenizer.from_model_path(resolve_model_path(config.model))
    server = grpc.aio.server(options=SERVER_OPTIONS)
    service = GatewayService(config, tokenizer)
    api_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(service.health, server)
    await service.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop() -> None:
        await service.health.enter_graceful_shutdown()

    await serve_aio(server, "gateway", config.host, config.port, service.watch_scheduler, stop)
    await service.channel.close()
