"""Anthropic's Messages API answer: one `message` object, or its stream of events

    message_start
    per content block (thinking, text, tool_use): content_block_start,
        content_block_delta (thinking_delta / text_delta / input_json_delta, a call's whole
        input at once), content_block_stop
    message_delta (stop_reason, output usage), message_stop

stop_reason: end_turn, max_tokens, stop_sequence (stop_sequence names it), or tool_use when the
answer made calls. Calls and thinking are
read from the text as the chat API reads them (gateway/openai_tools.py, gateway/reasoning.py).
"""

from __future__ import annotations

import json
from typing import Any

from llmserve.gateway.choices import Choice
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.openai_protocol import ChatCompletionRequest, ErrorResponse
from llmserve.gateway.openai_responses import ResponseFormat, merged_message, named_event
from llmserve.gateway.openai_tools import AnswerStream, read_answer, tool_plan
from llmserve.gateway.reasoning import reasoning_stream
from llmserve.gateway.telemetry import FINISH_REASONS
from llmserve.protos import api_pb2

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a tool_use block (its id made Anthropic-like)."""
    call_id = "toolu_" + call["id"].removeprefix("call_")
    arguments = json.loads(call["function"]["arguments"])
    return {"type": "tool_use", "id": call_id, "name": call["function"]["name"], "input": arguments}


class AnthropicFormat(ResponseFormat):
    """One message (no n) rendered whole or as Anthropic's events."""

    body: ChatCompletionRequest
    done = ""

    def __init__(
        self,
        core: GatewayCore,
        choices: list[Choice],
        response_id: str,
        body: ChatCompletionRequest,
        model_name: str,
    ):
        super().__init__(core, choices, response_id, body)
        self.model = model_name  # Anthropic's clients read back the name they sent
        self.tool_format = core.tokenizer.tool_format
        self.plan = tool_plan(
            body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_format
        )
        self.answer = AnswerStream(self.plan, self.tool_format) if self.plan.names else None
        self.thinking = reasoning_stream(
            core.tokenizer, core.config.reasoning_parser, choices[0].valid, bool(self.plan.names)
        )
        self.block: str | None = None  # the kind of the content block open now
        self.num_blocks = 0  # blocks started
        self.num_calls = 0

    def _stop_fields(self, msg: api_pb2.GenerateResponse, num_calls: int) -> dict[str, Any]:
        """stop_reason and stop_sequence of the answer msg ends."""
        if msg.stop_string:
            return {"stop_reason": "stop_sequence", "stop_sequence": msg.stop_string}
        reason = _STOP_REASONS.get(FINISH_REASONS.get(msg.finish_reason, ""), "end_turn")
        reason = "tool_use" if num_calls and reason == "end_turn" else reason
        return {"stop_reason": reason, "stop_sequence": None}

    def _message(
        self, content: list[dict[str, Any]], stop: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **(stop or {"stop_reason": None, "stop_sequence": None}),
            "usage": {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.completion_tokens,
                "cache_read_input_tokens": self.cached_tokens,
                "cache_creation_input_tokens": 0,
            },
        }

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        [choice] = self.choices
        msg = merged_message(messages[choice.index])
        self._count(choice, msg)
        reasoning, text = self.thinking.split(msg.text) if self.thinking else ("", msg.text)
        calls: list[dict[str, Any]] = []
        if self.plan.names:
            text, calls = read_answer(self.plan, self.tool_format, text)
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [tool_use_block(c) for c in calls]
        message = self._message(content, self._stop_fields(msg, len(calls)))
        return json.dumps(message, ensure_ascii=False)

    # -- the event stream ----------------------------------------------------------------------

    def sse(self, payload: str) -> str:
        return named_event(payload)

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return json.dumps({"type": kind, **fields}, ensure_ascii=False)

    def opening(self) -> list[str]:
        return [self._event("message_start", message=self._message([]))]

    def events(self, choice: Choice, msg: api_pb2.GenerateResponse) -> list[str]:
        self._count(choice, msg)
        last = bool(msg.finish_reason)
        reasoning, text = "", msg.text
        if self.thinking is not None:
            reasoning, text = self.thinking.add(text)
            if last:
                more_reasoning, more_text = self.thinking.finish()
                reasoning, text = reasoning + more_reasoning, text + more_text
        calls: list[dict[str, Any]] = []
        if self.answer is not None:
            text, calls = self.answer.add(text, last)
        payloads = self._delta("thinking", {"thinking": reasoning}) if reasoning else []
        payloads += self._delta("text", {"text": text}) if text else []
        for call in calls:
            block = tool_use_block(call)
            payloads += self._start({**block, "input": {}})
            json_delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            payloads.append(
                self._event("content_block_delta", index=self.num_blocks - 1, delta=json_delta)
            )
            payloads += self._stop()
        self.num_calls += len(calls)
        if last:
            if not self.num_blocks:
                payloads += self._delta("text", {"text": ""})
            payloads += self._stop()
            delta = self._stop_fields(msg, self.num_calls)
            usage = {"output_tokens": self.completion_tokens}
            payloads += [self._event("message_delta", delta=delta, usage=usage)]
        return payloads

    def _start(self, block: dict[str, Any]) -> list[str]:
        payloads = self._stop()
        self.block = block["type"]
        self.num_blocks += 1
        return [
            *payloads,
            self._event("content_block_start", index=self.num_blocks - 1, content_block=block),
        ]

    def _stop(self) -> list[str]:
        """content_block_stop for the block open now (none when none is)."""
        if self.block is None:
            return []
        self.block = None
        return [self._event("content_block_stop", index=self.num_blocks - 1)]

    def _delta(self, kind: str, fields: dict[str, Any]) -> list[str]:
        """A thinking or text delta, in a block of its kind (started when another is open)."""
        payloads = []
        if self.block != kind:
            empty = {"thinking": "", "signature": ""} if kind == "thinking" else {"text": ""}
            payloads += self._start({"type": kind, **empty})
        if any(fields.values()):
            delta = {"type": f"{kind}_delta", **fields}
            payloads.append(
                self._event("content_block_delta", index=self.num_blocks - 1, delta=delta)
            )
        return payloads

    def closing(self) -> list[str]:
        return [self._event("message_stop")]

    def error_event(self, error: ErrorResponse) -> str:
        kind = "overloaded_error" if error.error.code == "service_unavailable" else "api_error"
        return self._event("error", error={"type": kind, "message": error.error.message})

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        raise NotImplementedError("the Messages API streams events(), not chunks")

    def usage_chunk(self) -> str:
        raise NotImplementedError("the Messages API's usage is in message_delta")
