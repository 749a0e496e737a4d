from llmserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class ChatPrompt(_message.Message):
    __slots__ = ("messages", "tools_json", "template_kwargs_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    template_kwargs_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., template_kwargs_json: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "max_tokens", "sampling", "stop", "stop_token_ids", "ignore_eos", "request_id", "disable_speculation", "user", "priority", "lora_name", "prompt_logprobs", "prompt_top_logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatPrompt
    token_ids: TokenIds
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    request_id: str
    disable_speculation: bool
    user: str
    priority: int
    lora_name: str
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatPrompt, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., disable_speculation: _Optional[bool] = ..., user: _Optional[str] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "logprobs", "finish_reason", "usage", "top_logprobs", "stop_string", "prompt_token_ids", "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    stop_string: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., stop_string: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprob_ranks: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "eos_token_ids", "instance_id", "num_replicas", "num_replicas_ready", "lora_names")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPLICAS_READY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    num_replicas: int
    num_replicas_ready: int
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., num_replicas: _Optional[int] = ..., num_replicas_ready: _Optional[int] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...
