"""The HTTP API's generating path, shared by its endpoints (chat completions, completions, the
Responses API): validate, admit, fan out into choices, and answer with one JSON response or an
event stream in the endpoint's format; a client that goes away cancels its choices upstream.

Neighbours: gateway/http.py (the app), gateway/choices.py (fan-out), gateway/openai_responses.py
and gateway/responses_format.py (the formats).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from llmserve.common.log import bind, get_logger
from llmserve.gateway.choices import (
    Choice,
    Messages,
    all_messages,
    first_messages,
    make_choices,
    run_choices,
)
from llmserve.gateway.core import GatewayCore, new_request_id
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.http_errors import ApiError, as_api_errors
from llmserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_request,
    check_queue,
    completion_requests,
)
from llmserve.gateway.openai_responses import ChatFormat, CompletionFormat, ResponseFormat
from llmserve.gateway.quotas import Admission
from llmserve.gateway.tenants import ApiKey, display_name
from llmserve.gateway.validation import ValidationError
from llmserve.protos import api_pb2

log = get_logger("gateway")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


def presented_key(request: Request) -> ApiKey | None:
    """The client key ApiKeyMiddleware found for request (None without keys configured)."""
    return getattr(request.state, "api_key", None)


async def _disconnected(request: Request) -> None:
    """Return when the client disconnects (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """work's result; if the client disconnects first, cancel work (and with it every scheduler
    request it holds) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        task.cancel()  # no-op when done
    if task in done:
        return task.result()
    raise ClientDisconnected


async def sse_events(
    fmt: ResponseFormat,
    first: list[tuple[Choice, api_pb2.GenerateResponse]],
    stream: Messages,
) -> AsyncIterator[str]:
    """The event stream of a streamed response, framed by fmt (chat and completions: `data:`
    lines ending in [DONE]; Responses: typed events). An error after the 200 arrives as an
    error event, which the openai SDK raises as APIError (Responses: its error event)."""
    try:
        for payload in fmt.opening():
            yield fmt.sse(payload)
        for choice, msg in first:
            for payload in fmt.events(choice, msg):
                yield fmt.sse(payload)
        async for choice, msg in stream:
            for payload in fmt.events(choice, msg):
                yield fmt.sse(payload)
        for payload in fmt.closing():
            yield fmt.sse(payload)
    except GatewayError as err:
        yield fmt.sse(fmt.error_event(ApiError.from_gateway(err, "prompt").body))
    finally:
        await stream.aclose()
    if fmt.done:
        yield fmt.done


# -- the generating path ---------------------------------------------------------------------------


FormatFactory = Callable[
    [GatewayCore, list[Choice], str, "CompletionRequest | ChatCompletionRequest"], ResponseFormat
]


@dataclass(frozen=True)
class Endpoint:
    """What one generating endpoint changes on the shared path: its ids, the field a prompt
    error names, its trace operation, how it renders, and its own names for the chat API's
    fields (renames: the Responses API's)."""

    id_prefix: str
    prompt_field: str
    operation: str
    make_format: FormatFactory
    renames: tuple[tuple[str, str], ...] = ()
    separator: str = "-"  # OpenAI's ids: chatcmpl-..., resp_...

    def new_id(self) -> str:
        return new_request_id(self.id_prefix).replace("-", self.separator, 1)


CHAT = Endpoint("chatcmpl", "messages", "chat", ChatFormat)  # type: ignore[arg-type]
COMPLETIONS = Endpoint("cmpl", "prompt", "text_completion", CompletionFormat)  # type: ignore[arg-type]


async def generate_response(
    core: GatewayCore,
    request: Request,
    body: CompletionRequest | ChatCompletionRequest,
    endpoint: Endpoint | None = None,
) -> Response:
    """Validate, fan out, and answer with one response or an event stream: a chat completion or
    a completion by body's type, unless endpoint says otherwise (the Responses API's)."""
    chat = isinstance(body, ChatCompletionRequest)
    endpoint = endpoint or (CHAT if chat else COMPLETIONS)
    response_id = endpoint.new_id()
    arrival = time.monotonic()

    def requests() -> list[api_pb2.GenerateRequest]:
        if isinstance(body, ChatCompletionRequest):
            made = [chat_request(body, core.tokenizer.tool_format)]
        else:
            made = completion_requests(body)
        lora_name = core.lora_for_model(body.model)
        for r in made:
            r.lora_name = lora_name
        return made

    with as_api_errors(endpoint.prompt_field, endpoint.renames):
        try:
            # On a worker thread: a long prompt or chat takes a while to render and tokenize.
            valids = await asyncio.to_thread(lambda: [core.validate(r) for r in requests()])
            check_queue(
                body.n, len(valids), core.replicas.limits.max_waiting if core.replicas.limits else 0
            )
            caller = core.caller(presented_key(request), body.user or "")
            bind(tenant=display_name(caller.tenant), key=caller.key_name)
            admission = core.admit(caller, valids, body.n)
        except (ValidationError, GatewayError) as err:
            code = err.code.name if isinstance(err, GatewayError) else "INVALID_ARGUMENT"
            core.telemetry.rejected(code, "http", arrival)
            raise
        try:
            fmt = endpoint.make_format(
                core, make_choices(valids, body.n, response_id), response_id, body
            )
            return await _respond(core, request, fmt, endpoint, admission, arrival)
        finally:
            if not admission.handed_over:  # run_choices never started: it cannot release it
                admission.release()


async def _respond(
    core: GatewayCore,
    request: Request,
    fmt: ResponseFormat,
    endpoint: Endpoint,
    admission: Admission,
    arrival: float,
) -> Response:
    """The response, or the event stream, of admitted requests (fmt's choices)."""
    stream = run_choices(
        core, fmt.choices, dict(request.headers), arrival, endpoint.operation, admission
    )
    headers = {"X-Request-Id": fmt.id}
    try:
        if not fmt.body.stream:
            messages = await until_disconnected(request, all_messages(stream))
            return Response(fmt.response(messages), headers=headers, media_type="application/json")
        first = await until_disconnected(request, first_messages(stream, len(fmt.choices)))
    except ClientDisconnected:
        log.info("client disconnected", request_id=fmt.id)
        return Response(status_code=499)
    events = sse_events(fmt, first, stream)
    return StreamingResponse(events, headers=headers, media_type="text/event-stream")
