"""OpenAI response bodies from the gateway's messages: one response, or one streamed chunk per
message; usage over all choices; logprobs in the chat and the legacy completions formats."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any

from pydantic import BaseModel

from llmserve.gateway.choices import Choice
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.detokenizer import IncrementalDetokenizer
from llmserve.gateway.openai_protocol import (
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
    ErrorResponse,
    PromptTokensDetails,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
    prompt_list,
)
from llmserve.gateway.openai_tools import AnswerStream, read_answer, tool_plan
from llmserve.gateway.prompt_logprobs import (
    echo_logprobs,
    finite,
    prompt_only,
    token_text,
    vllm_prompt_logprobs,
)
from llmserve.gateway.reasoning import reasoning_stream
from llmserve.gateway.telemetry import FINISH_REASONS
from llmserve.gateway.tokenizer import Tokenizer
from llmserve.protos import api_pb2, common_pb2


def _token_logprob(tokenizer: Tokenizer, token_id: int, logprob: float) -> TopLogprob:
    data = tokenizer.token_bytes(token_id)
    return TopLogprob(token=token_text(data), logprob=finite(logprob), bytes=list(data))


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


def stop_reason(choice: Choice, msg: api_pb2.GenerateResponse) -> int | str | None:
    """vLLM's stop_reason of a choice's last message: the stop string that ended it, or the stop
    token id (one of the request's stop_token_ids); None otherwise (EOS, length, mid-answer)."""
    if msg.finish_reason != common_pb2.FINISH_REASON_STOP:
        return None
    if msg.stop_string:
        return msg.stop_string
    last = msg.token_ids[-1] if msg.token_ids else None
    return last if last in choice.valid.submit.stop_token_ids else None


class CompletionLogprobsBuilder:
    """The legacy completions format for one choice, message by message. text_offset counts the
    characters of completion text before each token (a token inside a character gets the
    character's offset)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], num_chars: int = 0):
        """num_chars: the characters before the completion (the echoed prompt's)."""
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self.num_chars = num_chars

    def add(self, msg: api_pb2.GenerateResponse) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, (token_id, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=True)):
            token = token_text(self.tokenizer.token_bytes(token_id))
            out.tokens.append(token)
            out.token_logprobs.append(finite(logprob))
            out.text_offset.append(self.num_chars)
            self.num_chars += len(self.detok.add([token_id]))
            top: dict[str, float] = {}
            if i < len(msg.top_logprobs):
                ranked = msg.top_logprobs[i]
                for top_id, top_lp in zip(ranked.token_ids, ranked.logprobs, strict=True):
                    top.setdefault(token_text(self.tokenizer.token_bytes(top_id)), finite(top_lp))
            top.setdefault(token, finite(logprob))  # OpenAI always lists the chosen token too
            out.top_logprobs.append(top)
        return out


_TYPE_KEY = '{"type": "'


def named_event(payload: str) -> str:
    """A server-sent event named by its payload's type, for a payload that json.dumps wrote
    from a dict whose first key is "type" (the Responses and Messages APIs' events)."""
    assert payload.startswith(_TYPE_KEY), payload[:40]
    kind = payload[len(_TYPE_KEY) : payload.index('"', len(_TYPE_KEY))]
    return f"event: {kind}\ndata: {payload}\n\n"


class ResponseFormat(ABC):
    """How one endpoint renders messages: as streamed chunks or as one response. Its usage is
    over all choices: each prompt counted once, each choice's completion tokens."""

    def __init__(
        self,
        core: GatewayCore,
        choices: list[Choice],
        response_id: str,
        body: CompletionRequest | ChatCompletionRequest,
    ):
        self.core = core
        self.choices = choices
        self.body = body
        self.id = response_id
        self.created = int(time.time())
        # The adapter the request ran under, else the base model (the name the client gave
        # for it may be any: one model served).
        self.model = choices[0].valid.submit.lora_name if choices else ""
        self.model = self.model or core.model_id
        prompts = {c.prompt_index: len(c.valid.prompt_token_ids) for c in choices}
        self.prompt_tokens = sum(prompts.values())
        self.completion_tokens = 0
        self.cached_tokens = 0

    def _count(self, choice: Choice, msg: api_pb2.GenerateResponse) -> None:
        if msg.finish_reason:
            self.completion_tokens += msg.usage.completion_tokens
            if choice.sample_index == 0:
                self.cached_tokens += msg.usage.cached_prompt_tokens

    def _usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
        )

    def _json(
        self, body: type[BaseModel], choices: list[Any], usage: Usage | None, **dump: Any
    ) -> str:
        """body (a response or chunk class) with this response's id, time and model, as JSON."""
        return body(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=usage
        ).model_dump_json(**dump)

    # A stream's framing: one `data:` line per chunk, [DONE] last (the Responses API differs).
    done = "data: [DONE]\n\n"

    def sse(self, payload: str) -> str:
        """One server-sent event of payload (JSON)."""
        return f"data: {payload}\n\n"

    def opening(self) -> list[str]:
        """Chunks before any choice's first message."""
        return []

    def events(self, choice: Choice, msg: api_pb2.GenerateResponse) -> list[str]:
        """The streamed payloads (JSON) for one message of one choice."""
        return [self.chunk(choice, msg)]

    def closing(self) -> list[str]:
        """Payloads after every choice finished: the usage chunk when stream_options asks."""
        options = self.body.stream_options
        return [self.usage_chunk()] if options is not None and options.include_usage else []

    def error_event(self, error: ErrorResponse) -> str:
        """The payload that reports an error after the 200."""
        return error.model_dump_json()

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
        super().__init__(core, choices, response_id, body)
        # echo: each prompt's text before its choices' (token-id prompts decoded). With
        # logprobs, the prompt's logprobs come first too, with a choice's first message (the
        # one carrying them: docs/api.md#prompt-logprobs); max_tokens 0: nothing else.
        self.echoes = [
            p if isinstance(p, str) else core.tokenizer.decode(p)
            for p in (prompt_list(body.prompt) if body.echo else [])
        ]
        self.echo_logprobs = body.echo and body.logprobs is not None
        self.prompt_only = body.echo and body.max_tokens == 0
        self.logprobs = {
            c.index: CompletionLogprobsBuilder(
                core.tokenizer,
                c.valid.prompt_token_ids,
                len(self.echoes[c.prompt_index]) if self.echo_logprobs else 0,
            )
            for c in choices
            if body.logprobs is not None
        }

    def opening(self) -> list[str]:
        if not self.echoes or self.echo_logprobs:
            return []
        return [
            self._json(
                CompletionResponse,
                [CompletionChoice(index=c.index, text=self.echoes[c.prompt_index])],
                None,
            )
            for c in self.choices
        ]

    def _choice(self, choice: Choice, msg: api_pb2.GenerateResponse) -> CompletionChoice:
        if self.prompt_only:
            msg = prompt_only(msg)
        self._count(choice, msg)
        builder = self.logprobs.get(choice.index)
        out = CompletionChoice(
            index=choice.index,
            text=msg.text,
            logprobs=builder.add(msg) if builder else None,
            finish_reason=FINISH_REASONS.get(msg.finish_reason),
            stop_reason=stop_reason(choice, msg),
        )
        body = self.body
        assert isinstance(body, CompletionRequest)
        if msg.prompt_token_ids and body.prompt_logprobs is not None:
            tokenizer = self.core.tokenizer
            out.prompt_logprobs = vllm_prompt_logprobs(tokenizer, msg, body.prompt_logprobs)
        if msg.prompt_token_ids and self.echo_logprobs and out.logprobs is not None:
            echo = echo_logprobs(self.core.tokenizer, msg, body.logprobs or 0)
            out.text = self.echoes[choice.prompt_index] + out.text
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                setattr(out.logprobs, name, getattr(echo, name) + getattr(out.logprobs, name))
        return out

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        # prompt_logprobs is never streamed (refused with stream, as vLLM): chunks leave it out
        no_prompt = {"choices": {"__all__": {"prompt_logprobs"}}}
        return self._json(CompletionResponse, [self._choice(choice, msg)], None, exclude=no_prompt)

    def usage_chunk(self) -> str:
        return self._json(CompletionResponse, [], self._usage())

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        choices = [self._choice(c, merged_message(messages[c.index])) for c in self.choices]
        if self.echoes and not self.echo_logprobs:
            for choice, c in zip(choices, self.choices, strict=True):
                choice.text = self.echoes[c.prompt_index] + choice.text
        return self._json(CompletionResponse, choices, self._usage())


class ChatFormat(ResponseFormat):
    """Chat completions; with tools (not tool_choice "none") the text is read for calls in the
    model's format (gateway/tool_formats.py): streamed, a call goes out only once it is whole,
    and text that may begin one is held back until it does or cannot."""

    body: ChatCompletionRequest

    def __init__(
        self,
        core: GatewayCore,
        choices: list[Choice],
        response_id: str,
        body: ChatCompletionRequest,
    ):
        super().__init__(core, choices, response_id, body)
        self.tool_format = core.tokenizer.tool_format
        self.plan = tool_plan(
            body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_format
        )
        self.calls = {
            c.index: AnswerStream(self.plan, self.tool_format) for c in choices if self.plan.names
        }
        parser, with_tools = core.config.reasoning_parser, bool(self.plan.names)
        self.thinking = {
            c.index: stream
            for c in choices
            if (stream := reasoning_stream(core.tokenizer, parser, c.valid, with_tools)) is not None
        }

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return self._json(ChatCompletionChunk, choices, usage, exclude_none=True)

    def opening(self) -> list[str]:
        return [
            self._chunk(
                [ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]
            )
            for c in self.choices
        ]

    def _choice(self, choice: Choice, msg: api_pb2.GenerateResponse) -> dict[str, Any]:
        """The fields a choice and a streamed choice share, for msg (whose usage is counted)."""
        self._count(choice, msg)
        return {
            "index": choice.index,
            "logprobs": chat_logprobs(self.core.tokenizer, msg) if self.body.logprobs else None,
            "finish_reason": FINISH_REASONS.get(msg.finish_reason),
            "stop_reason": stop_reason(choice, msg),
        }

    def _split(self, choice: Choice, text: str, last: bool) -> tuple[str | None, str]:
        """(reasoning, content) of a streamed piece of choice's answer."""
        thinking = self.thinking.get(choice.index)
        if thinking is None:
            return None, text
        reasoning, content = thinking.add(text)
        if last:
            more_reasoning, more_content = thinking.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning or None, content

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        fields = self._choice(choice, msg)
        reasoning, text = self._split(choice, msg.text, last=bool(msg.finish_reason))
        stream = self.calls.get(choice.index)
        if stream is None:
            delta = ChatDelta(content=text or None, reasoning_content=reasoning)
            return self._chunk([ChatChunkChoice(delta=delta, **fields)])
        first = stream.num_calls
        text, calls = stream.add(text, last=bool(msg.finish_reason))
        if msg.finish_reason:
            fields["finish_reason"] = _with_calls(fields["finish_reason"], stream.num_calls)
        delta = ChatDelta(
            content=text or None,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCallDelta(index=first + k, **call) for k, call in enumerate(calls)
            ] or None,
        )  # fmt: skip
        return self._chunk([ChatChunkChoice(delta=delta, **fields)])

    def usage_chunk(self) -> str:
        return self._chunk([], self._usage())

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        choices = []
        for c in self.choices:
            msg = merged_message(messages[c.index])
            fields = self._choice(c, msg)
            thinking = self.thinking.get(c.index)
            reasoning, text = thinking.split(msg.text) if thinking else (None, msg.text)
            if not self.plan.names:
                message = ChatMessage(content=text, reasoning_content=reasoning or None)
                choices.append(ChatChoice(message=message, **fields))
                continue
            content, calls = read_answer(self.plan, self.tool_format, text)
            fields["finish_reason"] = _with_calls(fields["finish_reason"], len(calls))
            message = ChatMessage(
                content=content or None,
                reasoning_content=reasoning or None,
                tool_calls=[ToolCall(**call) for call in calls] or None,
            )
            choices.append(ChatChoice(message=message, **fields))
        response = self._json(ChatCompletionResponse, choices, self._usage())
        body = self.body
        assert isinstance(body, ChatCompletionRequest)
        if body.prompt_logprobs is None or not self.choices:
            return response
        first = merged_message(messages[self.choices[0].index])  # every choice's prompt is one
        scores = vllm_prompt_logprobs(self.core.tokenizer, first, body.prompt_logprobs)
        return (
            ChatCompletionResponse.model_validate_json(response)
            .model_copy(update={"prompt_logprobs": scores})
            .model_dump_json()
        )


def _with_calls(finish_reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason for an answer that made calls: "tool_calls" where it stopped."""
    return "tool_calls" if num_calls and finish_reason == "stop" else finish_reason


def merged_message(msgs: list[api_pb2.GenerateResponse]) -> api_pb2.GenerateResponse:
    """One message as if msgs had come as one: their tokens and text, the last one's finish
    reason and usage."""
    out = api_pb2.GenerateResponse()
    for msg in msgs:
        out.MergeFrom(msg)  # token fields add up; finish reason and usage come with the last
    out.text = "".join(m.text for m in msgs)
    return out
