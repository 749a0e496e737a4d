from llmserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_DEVICE: _ClassVar[KVTier]
    KV_TIER_HOST: _ClassVar[KVTier]
    KV_TIER_DISK: _ClassVar[KVTier]
KV_TIER_DEVICE: KVTier
KV_TIER_HOST: KVTier
KV_TIER_DISK: KVTier

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "sampling", "block_table", "num_computed_tokens", "num_scheduled_tokens", "lora_slot", "state_slot", "prompt_logprobs", "prompt_top_logprobs", "state_restore_from")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATE_RESTORE_FROM_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    sampling: _common_pb2.SamplingParams
    block_table: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int
    state_slot: int
    prompt_logprobs: bool
    prompt_top_logprobs: int
    state_restore_from: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., block_table: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., lora_slot: _Optional[int] = ..., state_slot: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ..., state_restore_from: _Optional[int] = ...) -> None: ...

class RunningColumns(_message.Message):
    __slots__ = ("seq_ids", "num_scheduled_tokens", "num_computed_tokens", "num_new_blocks", "new_block_ids", "num_lookahead_tokens", "lora_slot")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_lookahead_tokens: _containers.RepeatedScalarFieldContainer[int]
    lora_slot: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_lookahead_tokens: _Optional[_Iterable[int]] = ..., lora_slot: _Optional[_Iterable[int]] = ...) -> None: ...

class LoraLoad(_message.Message):
    __slots__ = ("slot", "lora_name", "path")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    slot: int
    lora_name: str
    path: str
    def __init__(self, slot: _Optional[int] = ..., lora_name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class BlockCopies(_message.Message):
    __slots__ = ("src_tier", "dst_tier", "src_ids", "dst_ids")
    SRC_TIER_FIELD_NUMBER: _ClassVar[int]
    DST_TIER_FIELD_NUMBER: _ClassVar[int]
    SRC_IDS_FIELD_NUMBER: _ClassVar[int]
    DST_IDS_FIELD_NUMBER: _ClassVar[int]
    src_tier: KVTier
    dst_tier: KVTier
    src_ids: _containers.RepeatedScalarFieldContainer[int]
    dst_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src_tier: _Optional[_Union[KVTier, str]] = ..., dst_tier: _Optional[_Union[KVTier, str]] = ..., src_ids: _Optional[_Iterable[int]] = ..., dst_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVSend(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "address")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    address: str
    def __init__(self, transfer_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., address: _Optional[str] = ...) -> None: ...

class KVReceive(_message.Message):
    __slots__ = ("transfer_id", "block_ids")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "finished_seq_ids", "new_requests", "running", "trace_context", "lora_loads", "kv_copies", "grammar_compiles", "kv_sends", "kv_receives", "kv_receive_cancels", "state_snapshot_from", "state_snapshot_to")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_COPIES_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_COMPILES_FIELD_NUMBER: _ClassVar[int]
    KV_SENDS_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVES_FIELD_NUMBER: _ClassVar[int]
    KV_RECEIVE_CANCELS_FIELD_NUMBER: _ClassVar[int]
    STATE_SNAPSHOT_FROM_FIELD_NUMBER: _ClassVar[int]
    STATE_SNAPSHOT_TO_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    running: RunningColumns
    trace_context: _containers.ScalarMap[str, str]
    lora_loads: _containers.RepeatedCompositeFieldContainer[LoraLoad]
    kv_copies: _containers.RepeatedCompositeFieldContainer[BlockCopies]
    grammar_compiles: _containers.RepeatedCompositeFieldContainer[GrammarCompile]
    kv_sends: _containers.RepeatedCompositeFieldContainer[KVSend]
    kv_receives: _containers.RepeatedCompositeFieldContainer[KVReceive]
    kv_receive_cancels: _containers.RepeatedScalarFieldContainer[int]
    state_snapshot_from: _containers.RepeatedScalarFieldContainer[int]
    state_snapshot_to: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., running: _Optional[_Union[RunningColumns, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., lora_loads: _Optional[_Iterable[_Union[LoraLoad, _Mapping]]] = ..., kv_copies: _Optional[_Iterable[_Union[BlockCopies, _Mapping]]] = ..., grammar_compiles: _Optional[_Iterable[_Union[GrammarCompile, _Mapping]]] = ..., kv_sends: _Optional[_Iterable[_Union[KVSend, _Mapping]]] = ..., kv_receives: _Optional[_Iterable[_Union[KVReceive, _Mapping]]] = ..., kv_receive_cancels: _Optional[_Iterable[int]] = ..., state_snapshot_from: _Optional[_Iterable[int]] = ..., state_snapshot_to: _Optional[_Iterable[int]] = ...) -> None: ...

class GrammarCompile(_message.Message):
    __slots__ = ("seq_id", "structured_output")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    structured_output: _common_pb2.StructuredOutput
    def __init__(self, seq_id: _Optional[int] = ..., structured_output: _Optional[_Union[_common_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "logprobs", "forward_ms", "sample_ms", "total_ms", "num_top_logprobs", "top_token_ids", "top_logprobs", "refused_seq_ids", "refusal_reasons", "num_draft_tokens", "num_sampled_tokens", "compiled_seq_ids", "received_transfer_ids", "failed_transfer_ids", "dead_end_seq_ids", "num_prompt_logprobs", "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_token_ids", "prompt_top_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_REASONS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPILED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    DEAD_END_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_ms: float
    sample_ms: float
    total_ms: float
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    refused_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    refusal_reasons: _containers.RepeatedScalarFieldContainer[str]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_sampled_tokens: _containers.RepeatedScalarFieldContainer[int]
    compiled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    received_transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    dead_end_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_logprobs: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., refused_seq_ids: _Optional[_Iterable[int]] = ..., refusal_reasons: _Optional[_Iterable[str]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., num_sampled_tokens: _Optional[_Iterable[int]] = ..., compiled_seq_ids: _Optional[_Iterable[int]] = ..., received_transfer_ids: _Optional[_Iterable[int]] = ..., failed_transfer_ids: _Optional[_Iterable[int]] = ..., dead_end_seq_ids: _Optional[_Iterable[int]] = ..., num_prompt_logprobs: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprob_ranks: _Optional[_Iterable[int]] = ..., prompt_top_token_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AddLoraRequest(_message.Message):
    __slots__ = ("lora_name", "path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    path: str
    def __init__(self, lora_name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class AddLoraResponse(_message.Message):
    __slots__ = ("rank", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class RemoveLoraResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "eos_token_ids", "block_size", "num_blocks", "device", "dtype", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "pipeline_parallel_size", "speculative_method", "num_speculative_tokens", "sliding_window", "max_loras", "max_lora_rank", "num_host_blocks", "num_disk_blocks", "kv_block_bytes", "engine_role", "kv_transfer_address", "num_state_slots", "num_state_snapshot_slots")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SNAPSHOT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    speculative_method: str
    num_speculative_tokens: int
    sliding_window: int
    max_loras: int
    max_lora_rank: int
    num_host_blocks: int
    num_disk_blocks: int
    kv_block_bytes: int
    engine_role: str
    kv_transfer_address: str
    num_state_slots: int
    num_state_snapshot_slots: int
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., pipeline_parallel_size: _Optional[int] = ..., speculative_method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., sliding_window: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., num_host_blocks: _Optional[int] = ..., num_disk_blocks: _Optional[int] = ..., kv_block_bytes: _Optional[int] = ..., engine_role: _Optional[str] = ..., kv_transfer_address: _Optional[str] = ..., num_state_slots: _Optional[int] = ..., num_state_snapshot_slots: _Optional[int] = ...) -> None: ...
