"""A request's way through the replicas and back as text:

    routed_messages: the router's replica, others if it fails before its first token
    stream_text:     token ids -> detokenized text, held back at stop strings

A request the server ends itself (the scheduler's finish reason ABORT: it is shutting down, or its
engine came back too small to hold the request) and one whose scheduler was lost mid-stream are
UNAVAILABLE errors, which a client can retry, never a finish reason. So is one an operator aborts
(Admin.AbortRequest, or a Drain that timed out): it is never retried on another replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc

from llmserve.common.log import get_logger
from llmserve.gateway.detokenizer import IncrementalDetokenizer
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.replicas import Attempt, ReplicaLink
from llmserve.gateway.router import Router
from llmserve.gateway.stop import StopStringMatcher
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.gateway.validation import ValidRequest
from llmserve.protos import api_pb2, common_pb2, scheduler_pb2

log = get_logger("gateway")

REPLICA_SILENT_MESSAGE = "its scheduler stopped answering"
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
SERVER_ENDED_MESSAGE = (
    "the server ended this request before it finished (shutting down, or its engine was lost); "
    "retry"
)


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


class RetryElsewhere(Exception):
    """A replica refused or lost a request before its first token: another may take it."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


async def routed_messages(
    router: Router,
    links: dict[str, ReplicaLink],
    submit: scheduler_pb2.SubmitRequest,
    metadata: tuple[tuple[str, str], ...],
    entry: InFlight,
) -> AsyncGenerator[scheduler_pb2.SubmitResponse, None]:
    """submit's messages from the replica router picks. Until the first message, a replica
    that refuses (UNAVAILABLE, RESOURCE_EXHAUSTED), ends the request (ABORT) or is lost is left
    for another, each tried once; the last refusal's code when none is left. A request an
    operator aborted (entry.aborted) is tried nowhere else."""
    tried: set[str] = set()
    refusal: RetryElsewhere | None = None
    while True:
        if entry.aborted:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, entry.aborted)
        replica = router.route(submit.prompt_token_ids, tried)
        if replica is None:
            raise _no_replica(refusal, len(router.replicas))
        tried.add(replica.address)
        link = links[replica.address]
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
            router.done(replica)


async def stream_text(
    tokenizer: Tokenizer,
    request_id: str,
    valid: ValidRequest,
    messages: AsyncIterator[scheduler_pb2.SubmitResponse],
    entry: InFlight,
) -> AsyncIterator[api_pb2.GenerateResponse]:
    """messages as GenerateResponses: text detokenized incrementally, cut at the first stop
    string (finish reason STOP), the last carrying the finish reason and usage. Counts the
    tokens entry generated. GatewayError UNAVAILABLE for an ABORT, INTERNAL for a stream that
    ends without a finish reason."""
    detok = IncrementalDetokenizer(tokenizer, valid.prompt_token_ids, valid.skip_special_tokens)
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
        if valid.submit.prompt_logprobs and not usage.completion_tokens:  # the first message
            out.prompt_token_ids.extend(valid.prompt_token_ids)
            out.prompt_logprobs.extend(msg.prompt_logprobs)
            out.prompt_logprob_ranks.extend(msg.prompt_logprob_ranks)
            out.prompt_top_logprobs.extend(msg.prompt_top_logprobs)
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
            out.stop_string = stops.matched or ""
            out.usage.CopyFrom(usage)
            yield out
            return
        yield out
        out = api_pb2.GenerateResponse(request_id=request_id)
    raise GatewayError(
        grpc.StatusCode.INTERNAL, "scheduler ended the stream without a finish reason"
    )


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
