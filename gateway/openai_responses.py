"""OpenAI response bodies from the gateway's messages: one response, or one streamed chunk per
message; usage over all choices; logprobs in the chat and the legacy completions formats."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod

from gateway.choices import Choice
from gateway.core import GatewayCore
from gateway.detokenizer import IncrementalDetokenizer
from gateway.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from gateway.tokenizer import Tokenizer
from protos import api_pb2, common_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
# OpenAI's stand-in for a logprob too small to print.
_MIN_LOGPROB = -9999.0


def finish_reason(msg: api_pb2.GenerateResponse) -> str | None:
    return FINISH_REASONS.get(msg.finish_reason)


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) and logprob > _MIN_LOGPROB else _MIN_LOGPROB


def token_text(data: bytes) -> str:
    """A token's text, or OpenAI's "bytes:\\xe4\\xb8" for a token that is part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def _token_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    data = tokenizer.token_bytes(token_id)
    return TopLogprob(token=token_text(data), logprob=_finite(logprob), bytes=list(data))


def chat_logprobs(tokenizer: Tokenizer, msg: api_pb2.GenerateResponse) -> ChoiceLogprobs:
    """The chat format's logprobs for the tokens of one message."""
    content = []
    for i, (token_id, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=True)):
        top = []
        if i < len(msg.top_logprobs):
            ranked = msg.top_logprobs[i]
            top = [
                _token_logprob(tokenizer, t, lp)
                for t, lp in zip(ranked.token_ids, ranked.logprobs, strict=True)
            ]
        chosen = _token_logprob(tokenizer, token_id, logprob)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChoiceLogprobs(content=content)


class CompletionLogprobsBuilder:
    """The legacy completions format for one choice, message by message. text_offset counts the
    characters of completion text before each token (a token inside a character gets the
    character's offset)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.num_chars = 0

    def add(self, msg: api_pb2.GenerateResponse) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, (token_id, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=True)):
            token = token_text(self.tokenizer.token_bytes(token_id))
            out.tokens.append(token)
            out.token_logprobs.append(_finite(logprob))
            out.text_offset.append(self.num_chars)
            self.num_chars += len(self.detok.add([token_id]))
            top: dict[str, float] = {}
            if i < len(msg.top_logprobs):
                ranked = msg.top_logprobs[i]
                for top_id, top_lp in zip(ranked.token_ids, ranked.logprobs, strict=True):
                    top.setdefault(token_text(self.tokenizer.token_bytes(top_id)), _finite(top_lp))
            top.setdefault(token, _finite(logprob))  # OpenAI always lists the chosen token too
            out.top_logprobs.append(top)
        return out


def merge_completion_logprobs(parts: list[CompletionLogprobs]) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[t for p in parts for t in p.tokens],
        token_logprobs=[t for p in parts for t in p.token_logprobs],
        top_logprobs=[t for p in parts for t in p.top_logprobs],
        text_offset=[t for p in parts for t in p.text_offset],
    )


class UsageCounter:
    """Usage over all choices: each prompt counted once, each choice's completion tokens."""

    def __init__(self, choices: list[Choice]):
        prompts = {c.prompt_index: len(c.valid.prompt_token_ids) for c in choices}
        self.prompt_tokens = sum(prompts.values())
        self.completion_tokens = 0
        self.cached_tokens = 0

    def add(self, choice: Choice, msg: api_pb2.GenerateResponse) -> None:
        if msg.finish_reason:
            self.completion_tokens += msg.usage.completion_tokens
            if choice.sample_index == 0:
                self.cached_tokens += msg.usage.cached_prompt_tokens

    def usage(self) -> Usage:
        return make_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)


class ResponseFormat(ABC):
    """How one endpoint renders messages: as streamed chunks or as one response."""

    def __init__(self, core: GatewayCore, choices: list[Choice], response_id: str):
        self.core = core
        self.choices = choices
        self.id = response_id
        self.created = int(time.time())
        self.model = core.model_id
        self.counter = UsageCounter(choices)

    def opening(self) -> list[str]:
        """Chunks before any choice's first message."""
        return []

    @abstractmethod
    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        """One streamed chunk (JSON) for one message of one choice."""

    @abstractmethod
    def usage_chunk(self) -> str:
        """The last streamed chunk (JSON) when usage was asked for: no choices, the usage."""

    @abstractmethod
    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        """The whole response (JSON) from every choice's messages, by choice index."""


class CompletionFormat(ResponseFormat):
    def __init__(
        self, core: GatewayCore, choices: list[Choice], response_id: str, body: CompletionRequest
    ):
        super().__init__(core, choices, response_id)
        self.logprobs = {
            c.index: CompletionLogprobsBuilder(core.tokenizer, c.valid.prompt_token_ids)
            for c in choices
            if body.logprobs is not None
        }

    def _choice(self, choice: Choice, msg: api_pb2.GenerateResponse) -> CompletionChoice:
        self.counter.add(choice, msg)
        builder = self.logprobs.get(choice.index)
        return CompletionChoice(
            index=choice.index,
            text=msg.text,
            logprobs=builder.add(msg) if builder else None,
            finish_reason=finish_reason(msg),
        )

    def _response(self, choices: list[CompletionChoice], usage: Usage | None) -> str:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump_json()

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        return self._response([self._choice(choice, msg)], None)

    def usage_chunk(self) -> str:
        return self._response([], self.counter.usage())

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        choices = []
        for c in self.choices:
            parts = [self._choice(c, m) for m in messages[c.index]]
            logprobs = [p.logprobs for p in parts if p.logprobs is not None]
            choices.append(
                CompletionChoice(
                    index=c.index,
                    text="".join(p.text for p in parts),
                    logprobs=merge_completion_logprobs(logprobs) if logprobs else None,
                    finish_reason=parts[-1].finish_reason,
                )
            )
        return self._response(choices, self.counter.usage())


class ChatFormat(ResponseFormat):
    def __init__(
        self,
        core: GatewayCore,
        choices: list[Choice],
        response_id: str,
        body: ChatCompletionRequest,
    ):
        super().__init__(core, choices, response_id)
        self.with_logprobs = body.logprobs

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump_json(exclude_none=True)

    def opening(self) -> list[str]:
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]
            )
            for c in self.choices
        ]

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        self.counter.add(choice, msg)
        return self._chunk(
            [
                ChatChunkChoice(
                    index=choice.index,
                    delta=ChatDelta(content=msg.text) if msg.text else ChatDelta(),
                    logprobs=chat_logprobs(self.core.tokenizer, msg)
                    if self.with_logprobs
                    else None,
                    finish_reason=finish_reason(msg),
                )
            ]
        )

    def usage_chunk(self) -> str:
        return self._chunk([], self.counter.usage())

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        choices = []
        for c in self.choices:
            msgs = messages[c.index]
            for msg in msgs:
                self.counter.add(c, msg)
            logprobs = None
            if self.with_logprobs:
                logprobs = chat_logprobs(self.core.tokenizer, _all_tokens(msgs))
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatMessage(content="".join(m.text for m in msgs)),
                    logprobs=logprobs,
                    finish_reason=finish_reason(msgs[-1]),
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.counter.usage(),
        ).model_dump_json()


def _all_tokens(msgs: list[api_pb2.GenerateResponse]) -> api_pb2.GenerateResponse:
    """One message with the token fields of all msgs."""
    out = api_pb2.GenerateResponse()
    for msg in msgs:
        out.token_ids.extend(msg.token_ids)
        out.logprobs.extend(msg.logprobs)
        out.top_logprobs.extend(msg.top_logprobs)
    return out
