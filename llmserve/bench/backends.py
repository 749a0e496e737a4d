"""One streamed request, timed, against a server: gRPC (protos/api.proto, Generation.Generate) or
OpenAI-style HTTP (`POST /v1/completions` or `/v1/chat/completions` with `"stream": true`,
server-sent events).

A backend fills a RequestRecord: the arrival time of each chunk that carries tokens, how many
tokens it carries, the status. Output tokens are counted from what the server says it generated,
never from text and never including the prompt: over gRPC, the token ids each response carries;
over HTTP, the final usage chunk (`stream_options.include_usage`), falling back to one token per
chunk when a server sends no usage (the record says which).

The HTTP client is a small HTTP/1.1 reader on asyncio streams (one connection per request,
chunked or plain bodies), so the benchmark needs no HTTP library.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc

from llmserve.bench.metrics import RequestRecord
from llmserve.bench.workload import BenchRequest
from llmserve.client import finish_reason_name, make_request
from llmserve.common.net import CHANNEL_OPTIONS
from llmserve.protos import api_pb2, api_pb2_grpc

BACKENDS = ("grpc", "openai")


@dataclass(frozen=True)
class SamplingConfig:
    """What every request asks besides its prompt and max_tokens."""

    temperature: float = 0.0
    ignore_eos: bool = True
    seed: int | None = None
    timeout_s: float | None = None  # per request deadline

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0")


class BackendError(Exception):
    """The server cannot be used at all (unreachable, no model); the message says why."""


class Backend(Protocol):
    name: str

    async def describe(self) -> dict[str, Any]:
        """What the server says it runs; raises BackendError if it cannot be reached."""
        ...

    async def send(self, request: BenchRequest, record: RequestRecord, sent: float) -> None:
        """Send request and stream it to the end, filling record; `sent` is the perf_counter
        reading taken just before. Never raises for a refused or failed request."""
        ...

    async def close(self) -> None: ...


# -- gRPC -----------------------------------------------------------------------------------------


class GrpcBackend:
    name = "grpc"

    def __init__(
        self,
        address: str,
        sampling: SamplingConfig,
        keep_token_ids: bool = False,
        api_key: str | None = None,
    ):
        self.address = address
        self.sampling = sampling
        self.keep_token_ids = keep_token_ids
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self.channel: grpc.aio.Channel | None = None
        self._stub: api_pb2_grpc.GenerationStub | None = None

    @property
    def stub(self) -> api_pb2_grpc.GenerationStub:
        """The channel opens on first use, inside the running event loop."""
        if self._stub is None:
            self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
            self._stub = api_pb2_grpc.GenerationStub(self.channel)
        return self._stub

    async def describe(self) -> dict[str, Any]:
        try:
            info = await self.stub.GetModelInfo(
                api_pb2.GetModelInfoRequest(), timeout=10, metadata=self.metadata
            )
        except grpc.aio.AioRpcError as err:
            raise BackendError(
                f"gateway at {self.address}: {err.code().name}: {err.details()}"
            ) from None
        return {
            "backend": self.name,
            "address": self.address,
            "model": info.model,
            "max_model_len": info.max_model_len,
            "vocab_size": info.vocab_size,
        }

    async def send(self, request: BenchRequest, record: RequestRecord, sent: float) -> None:
        if self.keep_token_ids:
            record.token_ids = []
        try:
            message = make_request(
                request.text,
                request.messages,
                max_tokens=request.max_tokens,
                temperature=self.sampling.temperature,
                seed=self.sampling.seed,
                ignore_eos=self.sampling.ignore_eos,
            )
            call = self.stub.Generate(
                message, timeout=self.sampling.timeout_s, metadata=self.metadata
            )
            async for msg in call:
                if msg.token_ids:
                    record.chunk_times_s.append(time.perf_counter() - sent)
                    record.chunk_num_tokens.append(len(msg.token_ids))
                    if record.token_ids is not None:
                        record.token_ids.extend(msg.token_ids)
                if msg.finish_reason:
                    record.finish_reason = finish_reason_name(msg.finish_reason)
                    record.num_prompt_tokens = msg.usage.prompt_tokens or record.num_prompt_tokens
        except grpc.aio.AioRpcError as err:
            record.status, record.error = err.code().name, err.details() or ""
        else:
            _check_finished(record)
        record.latency_s = time.perf_counter() - sent

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel, self._stub = None, None


def _check_finished(record: RequestRecord) -> None:
    """A stream that ended without a finish reason, or aborted by the server, failed."""
    if record.finish_reason is None:
        record.status, record.error = "INCOMPLETE", "the stream ended without a finish reason"
    elif record.finish_reason == "abort":
        record.status, record.error = "ABORTED", "the server aborted the request"


# -- OpenAI-compatible HTTP ----------------------------------------------------------------------


class OpenAIBackend:
    """`/v1/completions` (text prompts) or `/v1/chat/completions` (messages), streamed."""

    name = "openai"

    def __init__(
        self,
        base_url: str,
        sampling: SamplingConfig,
        model: str | None = None,
        api_key: str | None = None,
    ):
        # Accept the OpenAI SDK's form too (http://host:8000/v1).
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.sampling = sampling
        self.model = model
        self.api_key = api_key

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def describe(self) -> dict[str, Any]:
        try:
            status, body = await http_json(f"{self.base_url}/v1/models", self._headers())
        except (OSError, EOFError) as err:
            raise BackendError(f"{self.base_url}: {err or type(err).__name__}") from None
        models = body.get("data") if status == 200 and isinstance(body, dict) else None
        if self.model is None:
            if not models:
                raise BackendError(
                    f"{self.base_url}/v1/models answered {status} with no model; pass --model"
                )
            self.model = str(models[0]["id"])
        return {"backend": self.name, "base_url": self.base_url, "model": self.model}

    def body(self, request: BenchRequest) -> tuple[str, dict[str, Any]]:
        """The endpoint path and the JSON body for request."""
        s = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": s.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if s.ignore_eos:
            body["ignore_eos"] = True  # not in OpenAI's API; vLLM's and ours accept it
        if s.seed is not None:
            body["seed"] = s.seed
        if request.messages is not None:
            body["messages"] = [{"role": r, "content": c} for r, c in request.messages]
            return "/v1/chat/completions", body
        body["prompt"] = request.text
        return "/v1/completions", body

    async def send(self, request: BenchRequest, record: RequestRecord, sent: float) -> None:
        path, body = self.body(request)
        try:
            await asyncio.wait_for(
                self._stream(self.base_url + path, body, record, sent), self.sampling.timeout_s
            )
        except TimeoutError:
            record.status, record.error = "DEADLINE_EXCEEDED", "the request timed out"
        except (OSError, EOFError) as err:
            record.status, record.error = "CONNECTION_ERROR", str(err) or type(err).__name__
        except ValueError as err:  # a malformed event or HTTP framing
            record.status, record.error = "BAD_RESPONSE", str(err)
        record.latency_s = time.perf_counter() - sent

    async def _stream(
        self, url: str, body: dict[str, Any], record: RequestRecord, sent: float
    ) -> None:
        response = await HttpResponse.open(url, "POST", json.dumps(body).encode(), self._headers())
        try:
            if response.status != 200:
                record.status = f"HTTP {response.status}"
                record.error = _error_message(await response.read_all())
                return
            usage_tokens = None
            async for data in sse_events(response.body()):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.status, record.error = "STREAM_ERROR", _error_message(data.encode())
                    return
                usage_tokens = _apply_event(event, record, sent) or usage_tokens
            if usage_tokens is not None:
                # The server's count replaces the one-per-chunk placeholder.
                record.chunk_num_tokens = _spread(usage_tokens, len(record.chunk_num_tokens))
                record.output_tokens_from = "usage"
            else:
                record.output_tokens_from = "chunks"
            _check_finished(record)
        finally:
            response.close()

    async def close(self) -> None:
        pass


def _apply_event(event: dict[str, Any], record: RequestRecord, sent: float) -> int | None:
    """Record one streamed chunk; return usage.completion_tokens when the chunk has usage."""
    for choice in event.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            record.chunk_times_s.append(time.perf_counter() - sent)
            record.chunk_num_tokens.append(1)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = event.get("usage")
    if not usage:
        return None
    record.num_prompt_tokens = usage.get("prompt_tokens") or record.num_prompt_tokens
    return int(usage.get("completion_tokens", 0))


def _spread(total: int, num_chunks: int) -> list[int]:
    """Per-chunk token counts summing to total: one per chunk, the remainder on the last chunk
    (only their sum and the chunk times enter the metrics)."""
    if num_chunks == 0:
        return []
    return [1] * (num_chunks - 1) + [max(total - (num_chunks - 1), 0)]


def _error_message(body: bytes) -> str:
    """OpenAI-style {"error": {"message": ...}} or the body's text, shortened."""
    text = body.decode(errors="replace")
    try:
        error = json.loads(text).get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (json.JSONDecodeError, AttributeError):
        pass
    return text[:300]


# -- a small HTTP/1.1 client -----------------------------------------------------------------------


class HttpResponse:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.status = 0
        self.headers: dict[str, str] = {}

    @classmethod
    async def open(
        cls, url: str, method: str, body: bytes | None, headers: dict[str, str]
    ) -> HttpResponse:
        """Send the request and read the status line and headers."""
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        host = parts.hostname or "localhost"
        port = parts.port or (443 if secure else 80)
        context = ssl.create_default_context() if secure else None
        reader, writer = await asyncio.open_connection(host, port, ssl=context)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close"]
        lines += ["Accept: text/event-stream, application/json", "User-Agent: llmserve-bench"]
        if body is not None:
            lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
        await writer.drain()
        response = cls(reader, writer)
        status_line = (await reader.readline()).decode("latin-1").split()
        if len(status_line) < 2 or not status_line[1].isdigit():
            writer.close()
            raise ConnectionError(f"{url}: not an HTTP response: {' '.join(status_line)!r}")
        response.status = int(status_line[1])
        while (line := (await reader.readline()).decode("latin-1").strip()) != "":
            name, _, value = line.partition(":")
            response.headers[name.strip().lower()] = value.strip()
        return response

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (chunked, sized or until the connection closes)."""
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return
                yield await self.reader.readexactly(size)
                await self.reader.readline()  # the CRLF after each chunk
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                data = await self.reader.read(min(remaining, 65536))
                if not data:
                    return
                remaining -= len(data)
                yield data
        else:
            while data := await self.reader.read(65536):
                yield data

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self.body()])

    def close(self) -> None:
        self.writer.close()


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The data of each server-sent event (data lines joined by newlines), as it completes."""
    buffer = b""
    data_lines: list[str] = []
    async for chunk in chunks:
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.rstrip(b"\r").decode()
            if not line:
                if data_lines:
                    yield "\n".join(data_lines)
                    data_lines = []
            elif line.startswith("data:"):
                data_lines.append(line[5:].removeprefix(" "))
    if data_lines:
        yield "\n".join(data_lines)


async def http_json(url: str, headers: dict[str, str]) -> tuple[int, Any]:
    """GET url; (status, parsed JSON or None)."""
    response = await HttpResponse.open(url, "GET", None, headers)
    try:
        body = await response.read_all()
    finally:
        response.close()
    try:
        return response.status, json.loads(body)
    except json.JSONDecodeError:
        return response.status, None
