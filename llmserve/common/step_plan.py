"""The step contract's messages as typed data both sides use (protos/engine.proto): what a plan
brings (StepPlanData, its rows and parts), what a step returns (StepOutput). The scheduler builds
a StepPlanData from its plan (scheduler/service/convert.py), the engine reads one (engine/), and
`to_proto` / `from_proto` convert field by field under the .proto's names, so a field added to
the .proto is a field added here (tests/test_step_plan.py holds the two equal) and nothing in
either converter. Order and rules within a plan:
docs/architecture.md#the-step-contract-scheduler---engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from llmserve.common.plan_columns import OPTIONAL_COLUMNS
from llmserve.protos import engine_pb2


@dataclass
class NewRequest:
    """A request new to the engine, whole: its tokens, sampling and blocks."""

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: Any  # common_pb2.SamplingParams, passed through as the gateway sent it
    block_table: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int = 0  # the adapter's device slot (0: the base model)
    # the state pool's slot of a hybrid linear-attention model's request (engine.proto)
    state_slot: int = 0
    # Score the prompt's scheduled positions (StepOutput.num_prompt_logprobs), with this many
    # most likely tokens each (0 .. 20).
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    # A hybrid model's prefix-cache hit: the snapshot slot its state is restored from before
    # the forward (0: none; engine.proto).
    state_restore_from: int = 0


@dataclass
class RunningColumns:
    """The running rows, one column per field (common/plan_columns.py's rules): row i's new
    blocks are new_block_ids[sum(num_new_blocks[:i]) : sum(num_new_blocks[:i + 1])]; an
    optional column left empty reads as 0 per row (`column`)."""

    seq_ids: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_new_blocks: list[int] = field(default_factory=list)
    new_block_ids: list[int] = field(default_factory=list)
    # Speculative decoding: KV slots row i may fill with tokens the engine proposes.
    num_lookahead_tokens: list[int] = field(default_factory=list)
    lora_slot: list[int] = field(default_factory=list)

    def column(self, name: str) -> list[int]:
        """The column name, or 0 per row when it is an optional one left empty."""
        column: list[int] = getattr(self, name)
        if not column and name in OPTIONAL_COLUMNS:
            return [0] * len(self.seq_ids)
        return column


@dataclass(frozen=True)
class LoraLoad:
    """Put adapter lora_name (read from path, or the host cache) in device slot `slot` (1 ..
    max_loras) before the plan's rows run."""

    slot: int
    lora_name: str
    path: str = ""


@dataclass
class BlockCopies:
    """Block src_ids[i] of src_tier to slot dst_ids[i] of dst_tier (engine_pb2.KVTier values),
    before the plan's forward, in list order (engine/kv/offload.py)."""

    src_tier: int
    dst_tier: int
    src_ids: list[int]
    dst_ids: list[int]


@dataclass(frozen=True)
class GrammarCompile:
    """Compile waiting request seq_id's constraint (common.proto's StructuredOutput) and report
    it in a later StepOutput.compiled_seq_ids."""

    seq_id: int
    structured_output: Any


@dataclass(frozen=True)
class KVSend:
    """Read block_ids out of the pool before the forward; push them to the decode engine at
    address under transfer_id (engine/kv/disaggregation.py)."""

    transfer_id: int
    block_ids: list[int]
    address: str


@dataclass(frozen=True)
class KVReceive:
    """When transfer_id arrives whole, write it into block_ids and report it in the first
    result after (StepOutput.received_transfer_ids)."""

    transfer_id: int
    block_ids: list[int]


@dataclass
class StepPlanData:
    """One step for the engine. Batch order: new_requests, then running."""

    step_id: int
    finished_seq_ids: list[int]
    new_requests: list[NewRequest]
    running: RunningColumns = field(default_factory=RunningColumns)
    # Adapters placed in slots before the rows run (each row's slot: `lora_slot`).
    lora_loads: list[LoraLoad] = field(default_factory=list)
    # KV offload: copies between tiers, in order, before the forward.
    kv_copies: list[BlockCopies] = field(default_factory=list)
    # Structured output: waiting requests' grammars to compile.
    grammar_compiles: list[GrammarCompile] = field(default_factory=list)
    # Disaggregation: transfers to send, to await, and awaited ones given up (cancels first,
    # sends read the pool before the forward).
    kv_sends: list[KVSend] = field(default_factory=list)
    kv_receives: list[KVReceive] = field(default_factory=list)
    kv_receive_cancels: list[int] = field(default_factory=list)
    # State snapshots: after the forward, slot state_snapshot_from[i] into snapshot slot
    # state_snapshot_to[i] (a hybrid model's prefix cache; engine.proto).
    state_snapshot_from: list[int] = field(default_factory=list)
    state_snapshot_to: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """One step's results, per plan row (new requests first, then running ones): one token each,
    or num_sampled_tokens[i] for row i when that is not empty (speculative decoding: the accepted
    proposals, then the token sampled after them). Per-token columns (logprobs, top logprob
    counts) follow sampled_token_ids."""

    sampled_token_ids: list[int]  # -1 where the request is mid-prefill
    # The chosen tokens' logprobs, NaN on rows that did not ask; None when no row asked.
    logprobs: list[float] | None
    forward_ms: float
    sample_ms: float
    # When a row asked for top logprobs: how many each token returns (0 where it sampled
    # nothing), and those entries, token after token, most likely first.
    num_top_logprobs: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # Requests the engine refused (new ones it cannot run), and why. Their rows sample nothing.
    refused_seq_ids: list[int] = field(default_factory=list)
    refusal_reasons: list[str] = field(default_factory=list)
    # Speculative decoding, per row when any row had lookahead slots (else empty): tokens the
    # engine proposed, and tokens the row returns (accepted proposals + 1).
    num_draft_tokens: list[int] = field(default_factory=list)
    num_sampled_tokens: list[int] = field(default_factory=list)
    # Waiting requests whose grammar (an earlier plan's grammar_compiles) is compiled now.
    compiled_seq_ids: list[int] = field(default_factory=list)
    # Disaggregation: awaited transfers written into the pool since the last result, and
    # those whose connection failed (each once).
    received_transfer_ids: list[int] = field(default_factory=list)
    failed_transfer_ids: list[int] = field(default_factory=list)
    # Requests whose grammar allowed no token since the last result (EOS forced): each once.
    dead_end_seq_ids: list[int] = field(default_factory=list)
    # Prompt logprobs, per row when any row asked (else empty): how many prompt positions row i
    # scored; per position, the next prompt token's logprob and rank, and its row's
    # prompt_top_logprobs most likely tokens (engine.proto's StepResult).
    num_prompt_logprobs: list[int] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_logprob_ranks: list[int] = field(default_factory=list)
    prompt_top_token_ids: list[int] = field(default_factory=list)
    prompt_top_logprobs: list[float] = field(default_factory=list)


# The KV tiers by the names the scheduler gives them (scheduler/kv_offload.py), as KVTier values.
KV_TIERS = {
    "device": engine_pb2.KV_TIER_DEVICE,
    "host": engine_pb2.KV_TIER_HOST,
    "disk": engine_pb2.KV_TIER_DISK,
}

# The .proto message each type stands for, and the message fields it leaves to others (the
# plan's trace context: telemetry's; the result's step id and total time: the service's).
MESSAGES: dict[type, tuple[Any, frozenset[str]]] = {
    NewRequest: (engine_pb2.NewRequest, frozenset()),
    RunningColumns: (engine_pb2.RunningColumns, frozenset()),
    LoraLoad: (engine_pb2.LoraLoad, frozenset()),
    BlockCopies: (engine_pb2.BlockCopies, frozenset()),
    GrammarCompile: (engine_pb2.GrammarCompile, frozenset()),
    KVSend: (engine_pb2.KVSend, frozenset()),
    KVReceive: (engine_pb2.KVReceive, frozenset()),
    StepPlanData: (engine_pb2.StepPlan, frozenset({"trace_context"})),
    StepOutput: (engine_pb2.StepResult, frozenset({"step_id", "total_ms"})),
}
_BY_MESSAGE = {message.DESCRIPTOR.full_name: cls for cls, (message, _) in MESSAGES.items()}


def _spec(cls: type) -> tuple[Any, list[tuple[str, type | None, bool]]]:
    """cls's message, and its fields: (name, the type of MESSAGES its values are, or None;
    whether repeated), worked out once per type."""
    message, _ = MESSAGES[cls]
    descriptors = message.DESCRIPTOR.fields_by_name
    fields = []
    for f in dataclasses.fields(cls):
        d = descriptors[f.name]
        sub = _BY_MESSAGE.get(d.message_type.full_name) if d.message_type else None
        fields.append((f.name, sub, d.is_repeated))
    return message, fields


_SPECS = {cls: _spec(cls) for cls in MESSAGES}
T = TypeVar("T")


def to_proto(data: Any) -> Any:
    """data (one of MESSAGES' types) as its message, field for field."""
    message, fields = _SPECS[type(data)]
    values = {}
    for name, sub, repeated in fields:
        value = getattr(data, name)
        if value is None:
            continue  # StepOutput.logprobs: none asked
        if sub is not None:
            value = [to_proto(v) for v in value] if repeated else to_proto(value)
        values[name] = value
    return message(**values)


def from_proto(cls: type[T], msg: Any) -> T:
    """msg as cls (one of MESSAGES' types), field for field: repeated fields as lists, messages
    of MESSAGES' types converted, others (sampling parameters) kept as they are."""
    _, fields = _SPECS[cls]
    values = {}
    for name, sub, repeated in fields:
        value = getattr(msg, name)
        if sub is not None:
            value = [from_proto(sub, v) for v in value] if repeated else from_proto(sub, value)
        elif repeated:
            value = list(value)
        values[name] = value
    return cls(**values)


def output_from_proto(msg: engine_pb2.StepResult) -> StepOutput:
    """The result's fields (an empty logprobs column: None, no row asked)."""
    output = from_proto(StepOutput, msg)
    output.logprobs = output.logprobs or None
    return output
