"""Check every field of a GenerateRequest and turn it into token ids and limits.

Each error names the field, the value and the limit, as a person would want to read it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from gateway.tokenizer import ChatMessage, ChatTemplateError, Tokenizer
from protos import api_pb2

ROLES = ("system", "user", "assistant")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class ValidationError(ValueError):
    """A field is invalid; the message names it. Maps to INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int
    kv_capacity_tokens: int  # the whole KV pool; no request can outgrow it
    max_prompt_chars: int = 1 << 20  # refuse before tokenizing absurd inputs
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_top_logprobs: int = 20


@dataclass(frozen=True)
class ValidRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: bool
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0


def _show(value: float) -> str:
    """A float32 field as the client wrote it (0.1, not 0.10000000149011612)."""
    text = f"{value:.7g}"
    return text if any(c in text for c in ".eni") else text + ".0"


def _check_unknown_fields(req: api_pb2.GenerateRequest) -> None:
    """Refuse fields this server's API does not have (a newer client's), at any depth."""
    messages: list[tuple[str, Message]] = [("GenerateRequest", req)]
    if req.HasField("chat"):
        messages.append(("chat", req.chat))
        messages += [(f"chat.messages[{i}]", m) for i, m in enumerate(req.chat.messages)]
    for where, msg in messages:
        numbers = [f.field_number for f in unknown_fields.UnknownFieldSet(msg)]
        if numbers:
            raise ValidationError(
                f"unknown field number {numbers[0]} in {where} (this server's API does not "
                "have it; check the client's proto version)"
            )


def _check_sampling(req: api_pb2.GenerateRequest) -> None:
    if req.HasField("temperature") and not (
        math.isfinite(req.temperature) and req.temperature >= 0
    ):
        raise ValidationError(f"temperature={_show(req.temperature)} must be a finite number >= 0")
    if req.HasField("top_p") and not 0 < req.top_p <= 1:
        raise ValidationError(f"top_p={_show(req.top_p)} must be in (0, 1]")
    if req.HasField("top_k") and req.top_k < -1:
        raise ValidationError(f"top_k={req.top_k} must be >= -1 (-1 or 0 disables it)")
    if req.HasField("min_p") and not 0 <= req.min_p <= 1:
        raise ValidationError(f"min_p={_show(req.min_p)} must be in [0, 1]")
    if req.HasField("max_tokens") and req.max_tokens < 1:
        raise ValidationError(f"max_tokens={req.max_tokens} must be >= 1")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if req.HasField(name) and not -2 <= value <= 2:
            raise ValidationError(f"{name}={_show(value)} must be in [-2, 2]")
    if req.request_id and not _REQUEST_ID.fullmatch(req.request_id):
        raise ValidationError(
            f"request_id={req.request_id[:40]!r} must be 1-128 characters of letters, digits "
            "and . _ : -"
        )


def _check_logprobs(req: api_pb2.GenerateRequest, limits: Limits) -> None:
    if not 0 <= req.top_logprobs <= limits.max_top_logprobs:
        raise ValidationError(
            f"top_logprobs={req.top_logprobs} must be in [0, {limits.max_top_logprobs}]"
        )
    if req.top_logprobs and not req.logprobs:
        raise ValidationError(f"top_logprobs={req.top_logprobs} needs logprobs=true")


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


def _prompt_ids(req: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> list[int]:
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise ValidationError("prompt is missing: set either text or chat")
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
        total += len(m.content)
    if total > limits.max_prompt_chars:
        raise ValidationError(
            f"chat.messages have {total} characters; the limit is {limits.max_prompt_chars}"
        )
    try:
        return tokenizer.encode_chat([ChatMessage(m.role, m.content) for m in messages])
    except ChatTemplateError as err:
        raise ValidationError(f"chat.messages: {err}") from err


def validate(req: api_pb2.GenerateRequest, tokenizer: Tokenizer, limits: Limits) -> ValidRequest:
    """Raise ValidationError on the first bad field; otherwise the request, tokenized, with
    defaults filled in (max_tokens defaults to what is left of the context)."""
    _check_unknown_fields(req)
    _check_sampling(req)
    _check_logprobs(req, limits)
    _check_stops(req, limits)
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
            f"({bound}, one token left to generate)"
        )
    remaining = context - len(prompt)
    max_tokens = req.max_tokens if req.HasField("max_tokens") else remaining
    if max_tokens > remaining:
        raise ValidationError(
            f"max_tokens={max_tokens} exceeds the model's remaining context of {remaining} "
            f"tokens ({bound}, prompt {len(prompt)} tokens)"
        )
    return ValidRequest(
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        temperature=req.temperature if req.HasField("temperature") else 1.0,
        top_k=req.top_k if req.HasField("top_k") else -1,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        min_p=req.min_p if req.HasField("min_p") else 0.0,
        seed=req.seed if req.HasField("seed") else None,
        stop=list(req.stop),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        top_logprobs=req.top_logprobs,
    )
