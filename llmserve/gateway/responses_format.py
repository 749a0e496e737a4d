"""The Responses API's answer: one `response` object, or its stream of typed events
(response.created, per output item its added / delta / done events, response.completed or
response.incomplete), each with a sequence_number; an error after the 200 is an `error` event.
A thinking model's reasoning item (gateway/reasoning.py) comes first. Calls are read from the
text as the chat API reads them (gateway/openai_tools.py): a call goes out once whole. The
events in order: docs/api.md#responses-api. Neighbours: gateway/responses_request.py (the
request), gateway/responses_store.py.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from llmserve.gateway.choices import Choice
from llmserve.gateway.core import GatewayCore
from llmserve.gateway.openai_protocol import ChatCompletionRequest, ChatMessageParam, ErrorResponse
from llmserve.gateway.openai_responses import ResponseFormat, merged_message, named_event
from llmserve.gateway.openai_tools import AnswerStream, read_answer, tool_plan
from llmserve.gateway.reasoning import reasoning_stream
from llmserve.gateway.responses_request import ResponsesRequest
from llmserve.gateway.responses_store import StoredResponse
from llmserve.gateway.telemetry import FINISH_REASONS
from llmserve.protos import api_pb2

OnFinish = Callable[[str, StoredResponse], None]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {
        "type": "message",
        "id": _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": content if status == "completed" else [],
    }


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {
        "type": "reasoning",
        "id": _item_id("rs"),
        "summary": [],
        "content": content,
        "status": status,
    }


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a function_call output item."""
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def output_messages(output: list[dict[str, Any]]) -> list[ChatMessageParam]:
    """A response's output items as the chat turn a later request's history holds."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        for item in output
        if item["type"] == "function_call"
    ]
    return [ChatMessageParam(role="assistant", content=text, tool_calls=calls or None)]


class ResponsesFormat(ResponseFormat):
    """One response (the Responses API has no n) rendered whole or as events; on_finish gets
    the final response's id and what to store of it (the caller stores it when asked)."""

    body: ChatCompletionRequest
    done = ""  # no [DONE]: response.completed ends the stream

    def __init__(
        self,
        core: GatewayCore,
        choices: list[Choice],
        response_id: str,
        body: ChatCompletionRequest,
        request: ResponsesRequest,
        conversation: list[ChatMessageParam],
        on_finish: OnFinish,
    ):
        super().__init__(core, choices, response_id, body)
        self.request = request
        self.conversation = conversation  # history and input, without instructions
        self.on_finish = on_finish
        self.tool_format = core.tokenizer.tool_format
        self.plan = tool_plan(
            body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_format
        )
        self.answer = AnswerStream(self.plan, self.tool_format) if self.plan.names else None
        parser = core.config.reasoning_parser
        self.thinking = reasoning_stream(
            core.tokenizer, parser, choices[0].valid, bool(self.plan.names)
        )
        self.reasoning_item: dict[str, Any] | None = None  # the reasoning item being streamed
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.text_item: dict[str, Any] | None = None  # the message item being streamed
        self.text = ""
        self.reasoning = ""
        self.finish_reason: str | None = None

    # -- the response object -----------------------------------------------------------------

    def _response_usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _reasoning_tokens(self) -> int:
        """The thinking's length in tokens (its text re-encoded: the tags not counted)."""
        if self.thinking is None or not self.thinking.reasoning_text:
            return 0
        return len(self.core.tokenizer.encode(self.thinking.reasoning_text, False))

    def _object(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        r = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": r.store,
            "temperature": r.temperature,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice or ("auto" if r.tools else "none"),
            "tools": r.tools or [],
            "top_p": r.top_p,
            "truncation": "disabled",
            "usage": self._response_usage() if status != "in_progress" else None,
            "user": r.user,
            "metadata": r.metadata or {},
        }

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object; handed to on_finish."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        final = self._object(status, output)
        body = json.dumps(final, ensure_ascii=False)
        self.on_finish(self.id, StoredResponse(body, self.conversation + output_messages(output)))
        return final

    def response(self, messages: dict[int, list[api_pb2.GenerateResponse]]) -> str:
        [choice] = self.choices
        msg = merged_message(messages[choice.index])
        self._count(choice, msg)
        self.finish_reason = FINISH_REASONS.get(msg.finish_reason)
        reasoning, content = self.thinking.split(msg.text) if self.thinking else ("", msg.text)
        calls: list[dict[str, Any]] = []
        if self.plan.names:
            content, calls = read_answer(self.plan, self.tool_format, content)
        output = [reasoning_item(reasoning)] if reasoning else []
        output += [message_item(content)] if content or not calls else []
        output += [call_item(c) for c in calls]
        return json.dumps(self._finished(output), ensure_ascii=False)

    # -- the event stream ----------------------------------------------------------------------

    def sse(self, payload: str) -> str:
        return named_event(payload)

    def _event(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return json.dumps(event, ensure_ascii=False)

    def opening(self) -> list[str]:
        started = self._object("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def events(self, choice: Choice, msg: api_pb2.GenerateResponse) -> list[str]:
        self._count(choice, msg)
        last = bool(msg.finish_reason)
        reasoning, text = self._split(msg.text, last)
        payloads = self._reasoning_delta(reasoning) if reasoning else []
        calls: list[dict[str, Any]] = []
        if self.answer is not None:
            text, calls = self.answer.add(text, last)
        if text or calls:
            payloads += self._close_reasoning()
        payloads += self._text_delta(text) if text else []
        for call in calls:
            payloads += self._close_text()
            payloads += self._call_events(call_item(call))
        if last:
            self.finish_reason = FINISH_REASONS.get(msg.finish_reason)
            payloads += self._close_reasoning()
            if not any(i["type"] != "reasoning" for i in self.output) and self.text_item is None:
                payloads += self._text_delta("")  # an answer of nothing: one empty message
            payloads += self._close_text()
        return payloads

    def _split(self, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) of a streamed piece of the answer."""
        if self.thinking is None:
            return "", text
        reasoning, content = self.thinking.add(text)
        if last:
            more_reasoning, more_content = self.thinking.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return reasoning, content

    def _reasoning_delta(self, text: str) -> list[str]:
        payloads = []
        if self.reasoning_item is None:
            self.reasoning_item, self.reasoning = reasoning_item("", "in_progress"), ""
            payloads.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.output),
                    item=self.reasoning_item,
                )
            )
        self.reasoning += text
        where = self._where(self.reasoning_item)
        delta = self._event("response.reasoning_text.delta", content_index=0, delta=text, **where)
        return [*payloads, delta]

    def _close_reasoning(self) -> list[str]:
        if self.reasoning_item is None:
            return []
        item = {**reasoning_item(self.reasoning), "id": self.reasoning_item["id"]}
        where = self._where(item)
        payloads = [
            self._event(
                "response.reasoning_text.done", content_index=0, text=self.reasoning, **where
            ),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.reasoning_item = None
        return payloads

    def chunk(self, choice: Choice, msg: api_pb2.GenerateResponse) -> str:
        raise NotImplementedError("the Responses API streams events(), not chunks")

    def usage_chunk(self) -> str:
        raise NotImplementedError("the Responses API's usage is in response.completed")

    def closing(self) -> list[str]:
        final = self._finished(self.output)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [self._event(kind, response=final)]

    def error_event(self, error: ErrorResponse) -> str:
        info = error.error
        return self._event("error", code=info.code, message=info.message, param=info.param)

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.output)}

    def _text_delta(self, text: str) -> list[str]:
        payloads = []
        if self.text_item is None:
            self.text_item, self.text = message_item("", "in_progress"), ""
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            payloads += [
                self._event(
                    "response.output_item.added", output_index=len(self.output), item=self.text_item
                ),
                self._event(
                    "response.content_part.added", content_index=0, part=part,
                    **self._where(self.text_item),
                ),
            ]  # fmt: skip
        self.text += text
        if text:
            payloads.append(
                self._event(
                    "response.output_text.delta", content_index=0, delta=text, logprobs=[],
                    **self._where(self.text_item),
                )
            )  # fmt: skip
        return payloads

    def _close_text(self) -> list[str]:
        if self.text_item is None:
            return []
        item = {**message_item(self.text), "id": self.text_item["id"]}
        where = self._where(item)
        payloads = [
            self._event(
                "response.output_text.done", content_index=0, text=self.text, logprobs=[], **where
            ),
            self._event(
                "response.content_part.done", content_index=0, part=item["content"][0], **where
            ),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        self.text_item = None
        return payloads

    def _call_events(self, item: dict[str, Any]) -> list[str]:
        where = self._where(item)
        added = {**item, "arguments": "", "status": "in_progress"}
        payloads = [
            self._event("response.output_item.added", output_index=len(self.output), item=added),
            self._event("response.function_call_arguments.delta", delta=item["arguments"], **where),
            self._event(
                "response.function_call_arguments.done",
                arguments=item["arguments"],
                name=item["name"],
                **where,
            ),
            self._event("response.output_item.done", output_index=len(self.output), item=item),
        ]
        self.output.append(item)
        return payloads
