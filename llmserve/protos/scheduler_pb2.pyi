from llmserve.protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadLoraRequest(_message.Message):
    __slots__ = ("lora_name", "path", "replace")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    path: str
    replace: bool
    def __init__(self, lora_name: _Optional[str] = ..., path: _Optional[str] = ..., replace: _Optional[bool] = ...) -> None: ...

class LoadLoraResponse(_message.Message):
    __slots__ = ("rank", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class UnloadLoraRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraResponse(_message.Message):
    __slots__ = ("num_requests_using",)
    NUM_REQUESTS_USING_FIELD_NUMBER: _ClassVar[int]
    num_requests_using: int
    def __init__(self, num_requests_using: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "max_tokens", "stop_token_ids", "ignore_eos", "disable_speculation", "tenant", "tenant_weight", "priority", "lora_name", "prompt_logprobs", "prompt_top_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    disable_speculation: bool
    tenant: str
    tenant_weight: float
    priority: int
    lora_name: str
    prompt_logprobs: bool
    prompt_top_logprobs: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., disable_speculation: _Optional[bool] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "top_logprobs", "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprob_ranks: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_waiting", "scheduling_policy")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting: int
    scheduling_policy: str
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_waiting: _Optional[int] = ..., scheduling_policy: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_steps", "num_scheduled_tokens", "num_preemptions", "num_finished_requests", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "num_prefix_cache_hit_tokens", "schedule_ms", "update_ms", "step_rtt_ms", "engine_total_ms", "engine_forward_ms", "engine_sample_ms", "num_engine_resets", "num_prompt_tokens", "num_generated_tokens", "num_prefix_cache_query_tokens", "ready", "num_spec_rows", "num_spec_draft_tokens", "num_spec_accepted_tokens", "num_spec_draft_tokens_per_pos", "num_spec_accepted_tokens_per_pos", "num_preemptions_by_reason", "num_preemptions_refused", "draining", "tenants", "lora_names", "kv_offload_num_blocks", "kv_offload_hit_blocks", "kv_offload_blocks_in", "kv_offload_bytes_in", "kv_offload_dropped_blocks", "num_swap_ins", "swap_in_wait_s", "prefill_num_free_blocks", "prefill_num_blocks", "prefill_num_running", "prefill_num_waiting", "num_kv_transfers", "num_kv_transfers_done", "num_kv_transfers_failed", "kv_transfer_blocks", "kv_transfer_bytes", "kv_transfer_s", "num_transferring", "prefill_ready", "decode_ready", "engines", "kv_bytes_per_token", "num_state_slots", "num_free_state_slots", "num_state_snapshot_slots", "num_used_state_snapshot_slots")
    class NumPreemptionsByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadNumBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadHitBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadBlocksInEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadBytesInEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvOffloadDroppedBlocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class NumKvTransfersFailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_MS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_RTT_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINE_RESETS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ROWS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_DRAFT_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_BLOCKS_IN_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    KV_OFFLOAD_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_DONE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_READY_FIELD_NUMBER: _ClassVar[int]
    DECODE_READY_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SNAPSHOT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_STATE_SNAPSHOT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_scheduled_tokens: int
    num_preemptions: int
    num_finished_requests: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_prefix_cache_hit_tokens: int
    schedule_ms: float
    update_ms: float
    step_rtt_ms: float
    engine_total_ms: float
    engine_forward_ms: float
    engine_sample_ms: float
    num_engine_resets: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_prefix_cache_query_tokens: int
    ready: bool
    num_spec_rows: int
    num_spec_draft_tokens: int
    num_spec_accepted_tokens: int
    num_spec_draft_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_spec_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_preemptions_by_reason: _containers.ScalarMap[str, int]
    num_preemptions_refused: int
    draining: bool
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    kv_offload_num_blocks: _containers.ScalarMap[str, int]
    kv_offload_hit_blocks: _containers.ScalarMap[str, int]
    kv_offload_blocks_in: _containers.ScalarMap[str, int]
    kv_offload_bytes_in: _containers.ScalarMap[str, int]
    kv_offload_dropped_blocks: _containers.ScalarMap[str, int]
    num_swap_ins: int
    swap_in_wait_s: float
    prefill_num_free_blocks: int
    prefill_num_blocks: int
    prefill_num_running: int
    prefill_num_waiting: int
    num_kv_transfers: int
    num_kv_transfers_done: int
    num_kv_transfers_failed: _containers.ScalarMap[str, int]
    kv_transfer_blocks: int
    kv_transfer_bytes: int
    kv_transfer_s: float
    num_transferring: int
    prefill_ready: bool
    decode_ready: bool
    engines: _containers.RepeatedCompositeFieldContainer[EngineRow]
    kv_bytes_per_token: int
    num_state_slots: int
    num_free_state_slots: int
    num_state_snapshot_slots: int
    num_used_state_snapshot_slots: int
    def __init__(self, num_steps: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_finished_requests: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_prefix_cache_hit_tokens: _Optional[int] = ..., schedule_ms: _Optional[float] = ..., update_ms: _Optional[float] = ..., step_rtt_ms: _Optional[float] = ..., engine_total_ms: _Optional[float] = ..., engine_forward_ms: _Optional[float] = ..., engine_sample_ms: _Optional[float] = ..., num_engine_resets: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_prefix_cache_query_tokens: _Optional[int] = ..., ready: _Optional[bool] = ..., num_spec_rows: _Optional[int] = ..., num_spec_draft_tokens: _Optional[int] = ..., num_spec_accepted_tokens: _Optional[int] = ..., num_spec_draft_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_spec_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_preemptions_by_reason: _Optional[_Mapping[str, int]] = ..., num_preemptions_refused: _Optional[int] = ..., draining: _Optional[bool] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., lora_names: _Optional[_Iterable[str]] = ..., kv_offload_num_blocks: _Optional[_Mapping[str, int]] = ..., kv_offload_hit_blocks: _Optional[_Mapping[str, int]] = ..., kv_offload_blocks_in: _Optional[_Mapping[str, int]] = ..., kv_offload_bytes_in: _Optional[_Mapping[str, int]] = ..., kv_offload_dropped_blocks: _Optional[_Mapping[str, int]] = ..., num_swap_ins: _Optional[int] = ..., swap_in_wait_s: _Optional[float] = ..., prefill_num_free_blocks: _Optional[int] = ..., prefill_num_blocks: _Optional[int] = ..., prefill_num_running: _Optional[int] = ..., prefill_num_waiting: _Optional[int] = ..., num_kv_transfers: _Optional[int] = ..., num_kv_transfers_done: _Optional[int] = ..., num_kv_transfers_failed: _Optional[_Mapping[str, int]] = ..., kv_transfer_blocks: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ..., num_transferring: _Optional[int] = ..., prefill_ready: _Optional[bool] = ..., decode_ready: _Optional[bool] = ..., engines: _Optional[_Iterable[_Union[EngineRow, _Mapping]]] = ..., kv_bytes_per_token: _Optional[int] = ..., num_state_slots: _Optional[int] = ..., num_free_state_slots: _Optional[int] = ..., num_state_snapshot_slots: _Optional[int] = ..., num_used_state_snapshot_slots: _Optional[int] = ...) -> None: ...

class EngineRow(_message.Message):
    __slots__ = ("address", "role", "ready", "num_running", "num_waiting", "num_transferring", "num_free_blocks", "num_blocks", "num_engine_resets")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENGINE_RESETS_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: str
    ready: bool
    num_running: int
    num_waiting: int
    num_transferring: int
    num_free_blocks: int
    num_blocks: int
    num_engine_resets: int
    def __init__(self, address: _Optional[str] = ..., role: _Optional[str] = ..., ready: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_transferring: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_engine_resets: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "weight", "num_waiting", "num_running", "num_blocks", "num_prompt_tokens", "num_generated_tokens", "virtual_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIRTUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: float
    num_waiting: int
    num_running: int
    num_blocks: int
    num_prompt_tokens: int
    num_generated_tokens: int
    virtual_tokens: float
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[float] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., virtual_tokens: _Optional[float] = ...) -> None: ...

class ListRequestsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class RequestState(_message.Message):
    __slots__ = ("request_id", "tenant", "state", "priority", "num_prompt_tokens", "num_output_tokens", "num_computed_tokens", "num_blocks", "num_preemptions", "age_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tenant: str
    state: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_computed_tokens: int
    num_blocks: int
    num_preemptions: int
    age_s: float
    def __init__(self, request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., state: _Optional[str] = ..., priority: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class ListRequestsResponse(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestState]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestState, _Mapping]]] = ...) -> None: ...

class AbortRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortRequestResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("resume",)
    RESUME_FIELD_NUMBER: _ClassVar[int]
    resume: bool
    def __init__(self, resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining",)
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    def __init__(self, draining: _Optional[bool] = ...) -> None: ...
