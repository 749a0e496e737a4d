"""The HTTP API's errors in OpenAI's shape ({"error": {"message", "type", "param", "code"}}, and
Anthropic's under /v1/messages): validation messages in the HTTP API's field names, ApiError,
GatewayError's gRPC status mapped to an HTTP status, FastAPI's own errors rewritten, and the
error responses the OpenAPI document lists.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from llmserve.common.log import get_logger
from llmserve.gateway.anthropic_request import error_body
from llmserve.gateway.errors import GatewayError
from llmserve.gateway.openai_protocol import (
    ChatCompletionRequest,
    ChatMessageParam,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    StreamOptions,
    TextPart,
)
from llmserve.gateway.validation import CONTEXT_LENGTH, ValidationError

log = get_logger("gateway")

RETRY_AFTER_S = 1
ANTHROPIC_PATH = "/v1/messages"  # its errors take Anthropic's shape
# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "invalid_request_error", "permission_denied"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


# -- field names ---------------------------------------------------------------------------------


def field_path(loc: Sequence[int | str]) -> str:
    """A pydantic error location as the request spells it ("messages[1].content"), without the
    union member tags pydantic adds ("str", "list[TextPart]")."""
    path = ""
    for part in loc:
        if isinstance(part, int) or (isinstance(part, str) and part.isdigit()):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        elif part in _REQUEST_FIELDS:
            path += f".{part}"
    return path


_REQUEST_FIELDS = frozenset(
    name
    for model in (ChatCompletionRequest, CompletionRequest, ChatMessageParam, TextPart)
    for name in model.model_fields
) | frozenset(StreamOptions.model_fields)
_LEADING_FIELD = re.compile(r"^[a-z_]+(?:\.[a-z_]+)*")
_HTTP_NAMES = {
    "text": "prompt",
    "token_ids": "prompt",
    "chat.messages": "messages",
    "chat.template_kwargs_json": "chat_template_kwargs",
    "chat": "messages",
}


def http_message(message: str, prompt_field: str) -> tuple[str, str | None]:
    """A validation message in the HTTP API's field names, and the field it names (`param`)."""
    message = message.replace("sampling.", "")
    match = _LEADING_FIELD.match(message)
    if match is None:
        return message, None
    name = match.group(0)
    http_name = _HTTP_NAMES.get(name, prompt_field if name == "prompt" else name)
    return http_name + message[len(name) :], http_name.split(".")[0]


# -- errors ----------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error response in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(
            error=ErrorInfo(message=message, type=kind, param=param, code=code)
        )
        self.headers = headers

    @classmethod
    def from_gateway(cls, err: GatewayError, prompt_field: str) -> ApiError:
        status, kind, code = _HTTP_STATUS.get(err.code, (500, "server_error", "internal_error"))
        message, param = err.message, None
        if err.code == grpc.StatusCode.INVALID_ARGUMENT:
            message, param = http_message(err.message, prompt_field)
            code = "context_length_exceeded" if CONTEXT_LENGTH in message else None
        elif err.code == grpc.StatusCode.NOT_FOUND and err.message.startswith("model "):
            param, code = "model", "model_not_found"  # an adapter not served (GatewayCore)
        retry = None
        if status in (429, 503):
            retry = {"Retry-After": str(err.retry_after_s or RETRY_AFTER_S)}
        return cls(status, message, kind, param, code, retry)

    def response(self, path: str = "") -> Response:
        """The error response; under /v1/messages in Anthropic's shape ({"type": "error",
        "error": {"type", "message"}}), as its clients read it."""
        body = self.body.model_dump_json()
        if path.startswith(ANTHROPIC_PATH):
            body = json.dumps(error_body(self.status, self.body.error.message))
        return Response(
            body, status_code=self.status, headers=self.headers, media_type="application/json"
        )


def validation_error(err: RequestValidationError) -> ApiError:
    """FastAPI's 422 as OpenAI's 400, naming the first bad field."""
    first = err.errors()[0] if err.errors() else {}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('msg')}")
    if not loc:
        return ApiError(400, "the request body must be a JSON object")
    param, where = loc[0], field_path(loc)
    if first.get("type") == "missing":
        return ApiError(400, f"{where} is required", param=param)
    value = repr(first.get("input"))[:80]
    return ApiError(400, f"{where}={value}: {first.get('msg')}", param=param)


@contextmanager
def as_api_errors(prompt_field: str, renames: Sequence[tuple[str, str]] = ()) -> Iterator[None]:
    """ValidationError and GatewayError raised inside as ApiError; renames: (a pattern of the
    chat API's field, the endpoint's) for an endpoint that reuses the chat path under other
    names."""
    try:
        yield
    except ValidationError as err:
        message, param = http_message(str(err), prompt_field)
        raise _renamed(ApiError(400, message, param=param), renames) from err
    except GatewayError as err:
        raise _renamed(ApiError.from_gateway(err, prompt_field), renames) from err


def _renamed(error: ApiError, renames: Sequence[tuple[str, str]]) -> ApiError:
    """error with its message's leading field (and its param) in the endpoint's names; renames:
    (a regular expression matched at the message's start, its replacement)."""
    info = error.body.error
    for pattern, new in renames:
        message, found = re.subn("^" + pattern, new, info.message, count=1)
        if found:
            info.message = message
            info.param = re.split(r"[.\[ =]", message, maxsplit=1)[0]
            break
    return error


RETRY_AFTER_HEADER = {
    "Retry-After": {
        "description": "seconds to wait before retrying: for a tenant over its quota, computed "
        "from the quota (when the tokens-per-minute bucket holds the request, or when the "
        "tenant's oldest request is expected to end); otherwise 1",
        "schema": {"type": "integer", "minimum": 1},
    }
}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "an invalid value, named in `param`"},
    401: {"model": ErrorResponse, "description": "a missing or wrong API key"},
    413: {"model": ErrorResponse, "description": "a body over --max-request-bytes"},
    429: {
        "model": ErrorResponse,
        "description": "the scheduler's queue is full, or the tenant is over its tokens per "
        "minute or its concurrent requests (error.message names the tenant, the quota and its "
        "limit)",
        "headers": RETRY_AFTER_HEADER,
    },
    503: {
        "model": ErrorResponse,
        "description": "not ready, or draining (an operator's Drain)",
        "headers": RETRY_AFTER_HEADER,
    },
}


def add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours, FastAPI's 422 (as 400), Starlette's, bugs."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError) -> Response:
        return err.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_body(request: Request, err: RequestValidationError) -> Response:
        return validation_error(err).response(request.url.path)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException) -> Response:
        headers = dict(err.headers) if err.headers else None
        error = ApiError(err.status_code, str(err.detail), headers=headers)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception) -> Response:
        log.exception("HTTP request failed", path=request.url.path)
        error = ApiError(500, f"internal error: {type(err).__name__}", "server_error")
        return error.response(request.url.path)
