"""The OpenAI API's request and response shapes (pydantic), and the conversion of requests to ours.

Requests become `api_pb2.GenerateRequest`s, so they meet the same validation (gateway/validation.py)
as gRPC ones; only what the gRPC API lacks (n, prompt lists, the legacy logprobs integer, fields we
refuse) is checked here, with messages in the same style. Unknown fields are ignored, as OpenAI
does. Fields OpenAI lacks but vLLM users send (top_k, min_p, ignore_eos, stop_token_ids) work too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, model_validator

from llmserve.common.sampling import SamplingError, seed_value
from llmserve.gateway.openai_structured import structured_output, text_field
from llmserve.gateway.openai_tools import tool_plan
from llmserve.gateway.tool_formats import ToolFormat
from llmserve.gateway.validation import ValidationError
from llmserve.protos import api_pb2

MAX_CHOICES = 128  # n times the number of prompts
MAX_LOGPROBS = 20
_INT32 = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]


# -- requests ------------------------------------------------------------------------------------


class NullIsDefault(BaseModel):
    """An explicit null means the field's default, as OpenAI's schema allows for its nullable
    fields (n, stream, logprobs, parallel_tool_calls, stream_options.include_usage, ...): SDKs
    and proxies send them."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        defaulted = {
            key
            for key, value in data.items()
            if value is None
            and key in fields
            and not fields[key].is_required()
            and fields[key].default is not None
        }
        return {key: value for key, value in data.items() if key not in defaulted}


class StreamOptions(NullIsDefault):
    include_usage: bool = False


class SamplingRequest(NullIsDefault):
    """The fields both endpoints share (a null is the default: NullIsDefault)."""

    # The base model or a LoRA adapter (GET /v1/models); without adapters, any name is the base.
    model: str | None = None
    max_tokens: _INT32 | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None  # OpenAI's are int64, ours uint64: common.sampling.seed_value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(
        None,
        description="the tenant this request is for, when the server has no API keys naming "
        "tenants (--api-keys); with keys, the key decides and this is ignored",
    )
    # Beyond OpenAI's API, as vLLM accepts them.
    top_k: _INT32 | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[_INT32] | None = None
    priority: _INT32 = Field(
        0,
        description="under the scheduler's priority policy, lower runs first (vLLM's "
        "convention); ties go by arrival",
    )
    # vLLM's prompt logprobs: the prompt tokens' logprobs, each with this many (0 .. 20) most
    # likely tokens, as `prompt_logprobs` in the response (not streamed, as vLLM).
    prompt_logprobs: int | None = None
    # vLLM's, with no engine support yet: a value other than the no-op default is a 400
    # (a silently ignored penalty or floor would change the answer without saying so).
    repetition_penalty: float | None = None
    min_tokens: _INT32 | None = None
    # Ours: decode this request without speculative decoding (protos/api.proto).
    disable_speculation: bool = False
    # Structured output: OpenAI's response_format ({"type": "json_object"} or {"type":
    # "json_schema", "json_schema": {"name", "schema", "strict"}}), on both endpoints as vLLM
    # takes it, or vLLM's structured_outputs (exactly one of json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: _INT32 | None = 16  # OpenAI's default for this endpoint
    logprobs: int | None = None  # legacy: the number of most likely tokens per position
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessageParam(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    # An assistant turn's calls, and a tool turn's answer to one (gateway/openai_tools.py).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    # An assistant turn's thinking, sent back (vLLM's names for it; gpt-oss wants the thinking
    # of a tool-calling turn to continue it)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam]
    max_completion_tokens: _INT32 | None = None  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: _INT32 | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    # vLLM's: more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: the template's reasoning_effort (gpt-oss's "Reasoning: low|medium|high")
    reasoning_effort: str | None = None


REASONING_EFFORTS = ("low", "medium", "high")


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's variables: chat_template_kwargs, with reasoning_effort (which
    chat_template_kwargs may also set) checked."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ValidationError(
            f"reasoning_effort={str(effort)[:40]!r} must be one of {', '.join(REASONING_EFFORTS)}"
        )
    return kwargs


# -- responses -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """With echo, the prompt's tokens come first; its first token's logprob and top_logprobs
    are null (nothing predicts it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of prompt_logprobs: one token's logprob, rank and text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt position, token id -> entry (the prompt's token and the
# most likely ones); null for the first position, which nothing predicts.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string, or the stop token id (not EOS), that ended the choice
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    """Also each streamed chunk (object "text_completion" both ways, as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    """A streamed call: sent whole, once it is (OpenAI's deltas may split the arguments)."""

    index: int


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # vLLM's: the thinking of a reasoning model (gateway/reasoning.py); null for others
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string, or the stop token id (not EOS), that ended the choice
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, of the templated prompt


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string, or the stop token id (not EOS), that ended the choice
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llmserve"
    max_model_len: int
    # vLLM's: what the model was loaded from (`vllm bench serve` reads it for its tokenizer)
    root: str
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- request conversion --------------------------------------------------------------------------


# The endpoints spell these differently (completions: logprobs=k); each sets them itself.
_LOGPROB_FIELDS = ("logprobs", "top_logprobs")
_NOT_COPIED = (*_LOGPROB_FIELDS, "structured_output", "logit_bias")


def _check_common(body: SamplingRequest, num_prompts: int) -> None:
    if not 1 <= body.n <= MAX_CHOICES:
        raise ValidationError(f"n={body.n} must be in [1, {MAX_CHOICES}]")
    if body.n * num_prompts > MAX_CHOICES:
        raise ValidationError(
            f"n={body.n} times {num_prompts} prompts is {body.n * num_prompts} choices; "
            f"the limit is {MAX_CHOICES}"
        )
    if body.stream_options is not None and not body.stream:
        raise ValidationError("stream_options is only allowed with stream=true")
    if body.prompt_logprobs is not None:
        if not 0 <= body.prompt_logprobs <= MAX_LOGPROBS:
            raise ValidationError(
                f"prompt_logprobs={body.prompt_logprobs} must be in [0, {MAX_LOGPROBS}]"
            )
        if body.stream:
            raise ValidationError("prompt_logprobs is not available with stream=true (as vLLM)")
    if body.repetition_penalty is not None and body.repetition_penalty != 1.0:
        raise ValidationError(
            f"repetition_penalty={body.repetition_penalty} is not supported (only 1.0); "
            "use presence_penalty / frequency_penalty"
        )
    if body.min_tokens:
        raise ValidationError(f"min_tokens={body.min_tokens} is not supported (only 0)")


def check_queue(n: int, num_prompts: int, max_waiting: int) -> None:
    """Refuse more choices than the scheduler can ever queue at once (max_waiting; 0: unknown):
    they are submitted together, and a 429 would invite a retry that cannot succeed."""
    total = n * num_prompts
    if not max_waiting or total <= max_waiting:
        return
    if num_prompts == 1:
        raise ValidationError(
            f"n={n} is more than the scheduler queues at once (max_waiting={max_waiting})"
        )
    raise ValidationError(
        f"n={n} times {num_prompts} prompts is {total} choices; the scheduler queues at most "
        f"{max_waiting} (max_waiting={max_waiting})"
    )


def _sampling_fields(body: SamplingRequest, max_tokens: int | None) -> api_pb2.GenerateRequest:
    """The GenerateRequest fields the two endpoints share. The body's fields named as in
    common.SamplingParams go there as they are (unset ones keep the server's defaults)."""
    req = api_pb2.GenerateRequest(
        ignore_eos=body.ignore_eos,
        disable_speculation=body.disable_speculation,
        priority=body.priority,
        user=text_field("user", body.user or ""),
    )
    if max_tokens is not None:
        req.max_tokens = max_tokens
    structured = structured_output(body.response_format, body.structured_outputs)
    if structured is not None:
        req.sampling.structured_output.CopyFrom(structured)
    for field in req.sampling.DESCRIPTOR.fields:
        value = getattr(body, field.name, None)
        if value is not None and field.name not in _NOT_COPIED:
            setattr(req.sampling, field.name, _seed(value) if field.name == "seed" else value)
    for key, bias in (body.logit_bias or {}).items():
        req.sampling.logit_bias[_token_key(key)] = bias
    if isinstance(body.stop, str):
        req.stop.append(text_field("stop", body.stop))
    elif body.stop is not None:
        req.stop.extend(text_field(f"stop[{i}]", s) for i, s in enumerate(body.stop))
    req.stop_token_ids.extend(body.stop_token_ids or [])
    return req


def _token_key(key: str) -> int:
    """A logit_bias key: OpenAI's JSON object keys are token ids written as text."""
    if not (key.isascii() and key.isdigit() and int(key) < 2**31):
        raise ValidationError(f"logit_bias key {key[:40]!r} is not a token id")
    return int(key)


def _seed(seed: int) -> int:
    try:
        return seed_value(seed)
    except SamplingError as err:
        raise ValidationError(str(err)) from err


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completion: text, a list of texts, one list of token ids, or a list of
    them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ValidationError("prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [_in_range("prompt", prompt)]  # type: ignore[arg-type]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        return [_in_range(f"prompt[{i}]", p) for i, p in enumerate(prompt)]  # type: ignore[arg-type]
    raise ValidationError("prompt mixes texts and token ids; send one kind")


def _in_range(field: str, ids: list[int]) -> list[int]:
    """ids, if each fits the API's int32 token ids (the vocabulary is checked later)."""
    for i, t in enumerate(ids):
        if not 0 <= t < 2**31:
            raise ValidationError(f"{field}[{i}]={t} is not a token id (must be in [0, 2**31))")
    return list(ids)


def completion_requests(body: CompletionRequest) -> list[api_pb2.GenerateRequest]:
    """One GenerateRequest per prompt. Raises ValidationError (HTTP 400)."""
    prompts = prompt_list(body.prompt)
    _check_common(body, len(prompts))
    if body.max_tokens == 0 and not body.echo:
        raise ValidationError("max_tokens=0 must be >= 1 (0 is allowed only with echo=true)")
    if body.suffix:
        raise ValidationError("suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise ValidationError(f"best_of={body.best_of} is not supported (only best_of=n)")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise ValidationError(f"logprobs={body.logprobs} must be in [0, {MAX_LOGPROBS}]")
    requests = []
    for i, prompt in enumerate(prompts):
        # max_tokens 0 with echo: the prompt alone; one token is generated and dropped
        # (gateway/openai_responses.py, CompletionFormat).
        req = _sampling_fields(body, 1 if body.echo and body.max_tokens == 0 else body.max_tokens)
        if isinstance(prompt, list):
            req.token_ids.ids.extend(prompt)
        else:
            req.text = text_field(
                "prompt" if isinstance(body.prompt, str) else f"prompt[{i}]", prompt
            )
        if body.logprobs is not None:
            req.sampling.logprobs = True
            req.sampling.top_logprobs = body.logprobs
        _ask_prompt_logprobs(req, body.logprobs if body.echo else None, body.prompt_logprobs)
        requests.append(req)
    return requests


def _ask_prompt_logprobs(req: api_pb2.GenerateRequest, *top_ks: int | None) -> None:
    """Ask for the prompt's logprobs when any of top_ks (echo's logprobs, prompt_logprobs) is
    set, with the most alternatives any asks."""
    asked = [k for k in top_ks if k is not None]
    if asked:
        req.prompt_logprobs = True
        req.prompt_top_logprobs = max(asked)


def _message_text(i: int, message: ChatMessageParam) -> str:
    if message.content is None and message.tool_calls:
        return ""
    if message.content is None:
        raise ValidationError(f"messages[{i}].content is missing")
    if isinstance(message.content, str):
        return text_field(f"messages[{i}].content", message.content)
    texts = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise ValidationError(
                f"messages[{i}].content[{j}].type={part.type!r} is not supported (only 'text')"
            )
        texts.append(text_field(f"messages[{i}].content[{j}].text", part.text))
    return "".join(texts)


def chat_request(
    body: ChatCompletionRequest, tool_format: ToolFormat | None = None
) -> api_pb2.GenerateRequest:
    """The GenerateRequest for a chat completion; tool_format: the model's way of writing
    calls (Hermes when None). Raises ValidationError (HTTP 400)."""
    _check_common(body, 1)
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_format)
    max_tokens = body.max_completion_tokens
    req = _sampling_fields(body, max_tokens if max_tokens is not None else body.max_tokens)
    if plan.constraint is not None:
        if req.sampling.HasField("structured_output"):
            raise ValidationError(
                "tool_choice requires a call, which response_format / structured_outputs "
                "would constrain too; send one"
            )
        req.sampling.structured_output.CopyFrom(plan.constraint)
    if plan.tools:
        req.chat.tools_json = json.dumps(plan.tools, ensure_ascii=False)
    if kwargs := template_kwargs(body):
        req.chat.template_kwargs_json = json.dumps(kwargs, ensure_ascii=False)
    for i, m in enumerate(body.messages):
        role = "system" if m.role == "developer" else text_field(f"messages[{i}].role", m.role)
        message = req.chat.messages.add(role=role, content=_message_text(i, m))
        if m.tool_calls:
            message.tool_calls_json = json.dumps(m.tool_calls, ensure_ascii=False)
        if m.tool_call_id:
            message.tool_call_id = text_field(f"messages[{i}].tool_call_id", m.tool_call_id)
        if reasoning := m.reasoning_content or m.reasoning:
            message.reasoning_content = text_field(f"messages[{i}].reasoning_content", reasoning)
    if not body.messages:
        req.chat.SetInParent()  # validation then names the empty list
    req.sampling.logprobs = body.logprobs
    req.sampling.top_logprobs = body.top_logprobs or 0
    _ask_prompt_logprobs(req, body.prompt_logprobs)
    return req
