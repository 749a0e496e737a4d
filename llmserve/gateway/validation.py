"""Check every field of a GenerateRequest and turn it into token ids and limits.

Each error names the field, the value and the limit, as a person would want to read it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from llmserve.common.sampling import MAX_TOP_LOGPROBS, SamplingError, normalized, with_defaults
from llmserve.common.structured_output import ConstraintError, check_structured_output
from llmserve.gateway.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from llmserve.protos import api_pb2, common_pb2, scheduler_pb2

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's wording, which clients (litellm, langchain) match to tell a context overflow from
# other bad requests; the HTTP API adds code "context_length_exceeded" to a message holding it
CONTEXT_LENGTH = "This model's maximum context length is"
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class ValidationError(ValueError):
    """A field is invalid; the message names it. Maps to INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the whole KV pool; no request can outgrow it
    max_waiting: int = 0  # the scheduler's queue: requests that may wait at once (0: unknown)
    max_prompt_chars: int = 1 << 20  # refuse before tokenizing absurd inputs
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation: what the scheduler is sent (sampling params normalized,
    defaults filled in) and the stop strings, which stay in the gateway."""

    submit: scheduler_pb2.SubmitRequest
    stop: list[str]
    # False: the answer's text keeps the special tokens (harmony's markup, gateway/harmony.py)
    skip_special_tokens: bool = True

    @property
    def prompt_token_ids(self) -> list[int]:
        return list(self.submit.prompt_token_ids)

    @property
    def sampling(self) -> common_pb2.SamplingParams:
        return self.submit.sampling


def _check_unknown_fields(req: api_pb2.GenerateRequest) -> None:
    """Refuse fields this server's API does not have (a newer client's), at any depth."""
    messages: list[tuple[str, Message]] = [
        ("GenerateRequest", req),
        ("sampling", req.sampling),
        ("sampling.structured_output", req.sampling.structured_output),
    ]
    if req.HasField("chat"):
        messages.append(("chat", req.chat))
        messages += [(f"chat.messages[{i}]", m) for i, m in enumerate(req.chat.messages)]
    for where, msg in messages:
        fields = unknown_fields.UnknownFieldSet(msg)
        numbers = [fields[i].field_number for i in range(len(fields))]
        if numbers:
            raise ValidationError(
                f"unknown field number {numbers[0]} in {where} (this server's API does not "
                "have it; check the client's proto version)"
            )


def _check_request(
    req: api_pb2.GenerateRequest, defaults: Mapping[str, float]
) -> common_pb2.SamplingParams:
    """The normalized sampling params, the model's defaults where the request left a field
    unset; also checks max_tokens and request_id."""
    try:
        sampling = normalized(with_defaults(req.sampling, defaults))
        check_structured_output(sampling.structured_output, "sampling.structured_output.")
    except (SamplingError, ConstraintError) as err:
        raise ValidationError(str(err)) from err
    if req.HasField("max_tokens") and req.max_tokens < 1:
        raise ValidationError(f"max_tokens={req.max_tokens} must be >= 1")
    if not 0 <= req.prompt_top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValidationError(
            f"prompt_top_logprobs={req.prompt_top_logprobs} must be in [0, {MAX_TOP_LOGPROBS}]"
        )
    if req.prompt_top_logprobs and not req.prompt_logprobs:
        raise ValidationError("prompt_top_logprobs needs prompt_logprobs=true")
    if req.request_id and not _REQUEST_ID.fullmatch(req.request_id):
        raise ValidationError(
            f"request_id={req.request_id[:40]!r} must be 1-128 characters of letters, digits "
            "and . _ : -"
        )
    return sampling


def _check_logit_bias(req: api_pb2.GenerateRequest, limits: Limits) -> None:
    for t in sorted(req.sampling.logit_bias):
        if not 0 <= t < limits.vocab_size:
            raise ValidationError(
                f"sampling.logit_bias key {t} is outside the vocabulary [0, {limits.vocab_size})"
            )


def _check_stops(req: api_pb2.GenerateRequest, limits: Limits) -> None:
    if len(req.stop) > limits.max_stop_strings:
        raise ValidationError(
            f"stop has {len(req.stop)} strings; at most {limits.max_stop_strings} are allowed"
        )
    for i, s in enumerate(req.stop):
        if not s:
            raise ValidationError(f"stop[{i}] is empty")
        if len(s) > limits.max_stop_string_chars:
            raise ValidationError(
                f"stop[{i}] has {len(s)} characters; the limit is {limits.max_stop_string_chars}"
            )
    for i, t in enumerate(req.stop_token_ids):
        if not 0 <= t < limits.vocab_size:
            raise ValidationError(
                f"stop_token_ids[{i}]={t} is outside the vocabulary [0, {limits.vocab_size})"
            )


def prompt_token_ids(
    req: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits
) -> list[int]:
    """req's prompt as token ids, with the prompt's own checks (roles, characters, template,
    vocabulary) but not the context's (POST /tokenize). Raises ValidationError."""
    return _prompt_ids(req, tokenizer, limits)


def _prompt_ids(req: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt is missing: set text, chat or token_ids")
    if kind == "token_ids":
        return _token_ids(list(req.token_ids.ids), limits)
    if kind == "text":
        if not req.text:
            raise ValidationError("text is empty")
        if len(req.text) > limits.max_prompt_chars:
            raise ValidationError(
                f"text has {len(req.text)} characters; the limit is {limits.max_prompt_chars}"
            )
        return tokenizer.encode(req.text)
    messages = req.chat.messages
    if not messages:
        raise ValidationError("chat.messages is empty")
    total = 0
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise ValidationError(f"chat.messages[{i}].role={m.role!r} must be one of {ROLES}")
        total += len(m.content) + len(m.reasoning_content)
    if total > limits.max_prompt_chars:
        raise ValidationError(
            f"chat.messages have {total} characters; the limit is {limits.max_prompt_chars}"
        )
    turns = [
        ChatMessage(m.role, m.content, _tool_calls(f"chat.messages[{i}]", m.tool_calls_json),
                    m.tool_call_id, m.reasoning_content)
        for i, m in enumerate(messages)
    ]  # fmt: skip
    tools = _json_list("chat.tools_json", req.chat.tools_json)
    kwargs = _template_kwargs(req.chat.template_kwargs_json)
    try:
        return tokenizer.encode_chat(turns, tools, kwargs)
    except ChatTemplateError as err:
        raise ValidationError(f"chat.messages: {err}") from err


# What the gateway itself gives the template: chat_template_kwargs may not set these.
_TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


def _template_kwargs(text: str) -> dict[str, Any]:
    field = "chat.template_kwargs_json"
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValidationError(f"{field} is not JSON: {err}") from err
    if not isinstance(value, dict):
        raise ValidationError(f"{field} must be a JSON object")
    for name in _TEMPLATE_VARIABLES:
        if name in value:
            raise ValidationError(f"{field} sets {name!r}, which the server sets; leave it out")
    return value


def _json_list(field: str, text: str) -> list[Any]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValidationError(f"{field} is not JSON: {err}") from err
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ValidationError(f"{field} must be a JSON list of objects")
    return value


def _tool_calls(field: str, text: str) -> list[Any]:
    """An assistant turn's calls: OpenAI's {"function": {"name": str, "arguments": JSON text
    (or an object)}} each, the field of a bad one named."""
    calls = _json_list(f"{field}.tool_calls_json", text)
    for j, call in enumerate(calls):
        where = f"{field}.tool_calls[{j}].function"
        function = call.get("function")
        if not isinstance(function, dict):
            raise ValidationError(f'{where} must be an object {{"name": .., "arguments": ..}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ValidationError(f"{where}.name must be a non-empty string")
        if not isinstance(function.get("arguments", ""), str | dict):
            raise ValidationError(f"{where}.arguments must be a string (a JSON object's text)")
    return calls


def _token_ids(ids: list[int], limits: Limits) -> list[int]:
    if not ids:
        raise ValidationError("token_ids is empty")
    for i, t in enumerate(ids):
        if not 0 <= t < limits.vocab_size:
            raise ValidationError(
                f"token_ids[{i}]={t} is outside the vocabulary [0, {limits.vocab_size})"
            )
    return ids


def validate(
    req: api_pb2.GenerateRequest,
    tokenizer: Tokenizer,
    limits: Limits,
    sampling_defaults: Mapping[str, float] | None = None,
) -> ValidRequest:
    """Raise ValidationError on the first bad field; otherwise the request, tokenized, with
    defaults filled in (max_tokens defaults to what is left of the context; sampling fields to
    sampling_defaults, the model's generation_config.json, then common.sampling's)."""
    _check_unknown_fields(req)
    sampling = _check_request(req, sampling_defaults or {})
    _check_stops(req, limits)
    _check_logit_bias(req, limits)
    prompt = _prompt_ids(req, tokenizer, limits)
    if not prompt:
        raise ValidationError("prompt tokenizes to nothing")
    context = min(limits.max_model_len, limits.kv_capacity_tokens)
    bound = (
        f"max_model_len={limits.max_model_len}"
        if limits.max_model_len <= limits.kv_capacity_tokens
        else f"the KV cache holds {limits.kv_capacity_tokens} tokens"
    )
    if len(prompt) >= context:
        raise ValidationError(
            f"prompt has {len(prompt)} tokens; the limit is {context - 1} "
            f"({bound}, one token left to generate). {CONTEXT_LENGTH} {context} tokens."
        )
    remaining = context - len(prompt)
    max_tokens = req.max_tokens if req.HasField("max_tokens") else remaining
    if max_tokens > remaining:
        raise ValidationError(
            f"max_tokens={max_tokens} exceeds the model's remaining context of {remaining} "
            f"tokens ({bound}, prompt {len(prompt)} tokens). {CONTEXT_LENGTH} {context} tokens."
        )
    submit = scheduler_pb2.SubmitRequest(
        prompt_token_ids=prompt,
        sampling=sampling,
        max_tokens=max_tokens,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        disable_speculation=req.disable_speculation,
        priority=req.priority,
        lora_name=req.lora_name,
        prompt_logprobs=req.prompt_logprobs,
        prompt_top_logprobs=req.prompt_top_logprobs,
    )
    return ValidRequest(submit, list(req.stop))
