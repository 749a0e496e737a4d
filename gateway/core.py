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
import uuid
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.log import get_logger
from common.model_config import default_model_id
from gateway.config import GatewayConfig
from gateway.detokenizer import IncrementalDetokenizer
from gateway.stop import StopStringMatcher
from gateway.telemetry import GatewayTelemetry, RequestTelemetry
from gateway.tokenizer import Tokenizer
from gateway.validation import Limits, ValidationError, ValidRequest, validate
from protos import api_pb2, common_pb2, scheduler_pb2, scheduler_pb2_grpc

log = get_logger("gateway")

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


class GatewayCore:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer):
        self.config = config
        self.tokenizer = tokenizer
        # What both APIs call the model (the engine's own name for it is only logged).
        self.model_id = config.served_model_name or default_model_id(config.model)
        self.channel = config.channel(config.scheduler_address)
        self.peer_metadata = config.peer_metadata()
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.info: scheduler_pb2.SchedulerInfo | None = None
        self.limits: Limits | None = None
        # The gRPC health service mirrors the scheduler's; `serving` is the same, for HTTP.
        self.health = health.aio.HealthServicer()
        self.serving = False
        self.telemetry = GatewayTelemetry()
        self.telemetry.model = self.model_id

    async def watch_scheduler(self) -> None:
        """Learn the limits from the scheduler, then mirror its health in ours."""
        health_stub = health_pb2_grpc.HealthStub(self.channel)
        serving = None
        while True:
            try:
                if self.info is None:
                    self.info = await self.stub.GetInfo(
                        scheduler_pb2.GetInfoRequest(), timeout=2, metadata=self.peer_metadata
                    )
                    self.limits = Limits(
                        max_model_len=self.info.max_model_len,
                        vocab_size=self.info.vocab_size,
                        kv_capacity_tokens=self.info.num_blocks * self.info.block_size,
                        max_waiting=self.info.max_waiting,
                    )
                    log.info(
                        "scheduler connected",
                        model=self.model_id,
                        engine_model=self.info.model,
                        max_model_len=self.info.max_model_len,
                    )
                reply = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                status = reply.status
            except grpc.aio.AioRpcError:
                status = health_pb2.HealthCheckResponse.NOT_SERVING
            if status != serving:
                serving = status
                self.serving = status == health_pb2.HealthCheckResponse.SERVING
                await self.health.set("", status)
            await asyncio.sleep(1.0)

    def model_info(self) -> api_pb2.ModelInfo:
        if self.info is None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "scheduler not connected yet")
        return api_pb2.ModelInfo(
            model=self.model_id,
            max_model_len=self.info.max_model_len,
            vocab_size=self.info.vocab_size,
            eos_token_ids=self.info.eos_token_ids,
            instance_id=self.config.instance_id,
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
        """Submit valid to the scheduler and stream its text. The last message carries the
        finish reason and usage. Raises GatewayError with the scheduler's code when it refuses
        (RESOURCE_EXHAUSTED: queue full) or loses the request. Ends trace."""
        submit = scheduler_pb2.SubmitRequest()
        submit.CopyFrom(valid.submit)
        submit.request_id = request_id
        call = self.stub.Submit(submit, metadata=(*self.peer_metadata, *trace.metadata()))
        try:
            async for msg in self._stream(request_id, valid, call):
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
            call.cancel()
            trace.finish(code="CANCELLED", message="client went away")  # no-op when finished

    async def _stream(
        self, request_id: str, valid: ValidRequest, call: grpc.aio.UnaryStreamCall
    ) -> AsyncIterator[api_pb2.GenerateResponse]:
        detok = IncrementalDetokenizer(self.tokenizer, valid.prompt_token_ids)
        stops = StopStringMatcher(valid.stop)
        out = api_pb2.GenerateResponse(request_id=request_id)
        usage = api_pb2.Usage(prompt_tokens=len(valid.prompt_token_ids))
        async for msg in _scheduler_messages(call):
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
        await self.channel.close()


async def _scheduler_messages(
    call: grpc.aio.UnaryStreamCall,
) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
    """call's messages. Losing the scheduler after the first one (it died, or the connection
    did) is UNAVAILABLE with a message that says so; other errors pass through."""
    received = False
    try:
        async for msg in call:
            received = True
            yield msg
    except grpc.aio.AioRpcError as err:
        if not received or err.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        raise GatewayError(
            grpc.StatusCode.UNAVAILABLE,
            f"lost the scheduler mid-request ({err.details()}); retry",
        ) from err
