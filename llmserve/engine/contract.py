"""The engine's side of the step contract as plain data (protos/engine.proto), torch-free: what a
plan brings (StepPlanData, with its KV copies between tiers: BlockCopiesData), what a step
returns (StepOutput) and what the engine reports of itself (EngineInfo, with its tiers' sizes
and its role). Disaggregation adds KV transfers to the plan (KVSendData on a prefill engine,
KVReceiveData and cancels on a decode engine) and the transfers received to the result: the
scheduler owns every engine's pool (N prefill and M decode engines) and decides every move, as
with the tiers; an engine knows only the addresses its plans name (docs/disaggregation.md).
Order within a plan: sends are read out of the pool before the plan's KV copies, receives are
written after them (a block freed at a handoff may be a swap-in's target in the same plan; a
block pinned for a transfer may have been evicted by it, its old contents copied down first).
engine/convert.py turns them into protobuf and back; the real engine, the fake one
and the service all speak these.

Structured output adds nothing to the plan's columns: the constraint travels once, in the new
request's SamplingParams (common.proto's StructuredOutput), and the engine keeps one grammar
matcher per request beside its mirrored tokens (engine/grammar.py). Why the engine and not the
scheduler: with overlap the scheduler plans step N+1 before step N's tokens reach it, so a mask
it shipped in the plan would be a step late, while the engine holds every sampled token first
and can fill step N+1's mask on a worker thread while N+1's forward runs. Why that keeps the
contract: a matcher follows the one token rule (it consumes the request's generated tokens up to
the newest before each mask), so a recompute after preemption rebuilds it from the token ids the
new request carries, a rejected speculative token is rolled back as the mirror drops it, and
n choices, being n requests, have one each. A grammar that allows no token lets only EOS through:
the request ends as a stop, seen by the scheduler's usual EOS rule.

Compiling a grammar is kept off the step path: a waiting constrained request's constraint is
listed once in a plan's grammar_compiles (GrammarCompileData) before the request is admitted; the
engine compiles it on its compile thread (the first one also builds the vocabulary, seconds) and
reports it in a later StepOutput's compiled_seq_ids (refused_seq_ids when it does not compile).
The scheduler admits the request only then. Why: a compile in a step would hold every row of that
step at sampling, while this way a request waits for its own grammar and the others step on."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from typing import TYPE_CHECKING, Any

from llmserve.common.plan_columns import COLUMNS, OPTIONAL_COLUMNS
from llmserve.protos import engine_pb2


@dataclass(frozen=True)
class EngineInfo:
    model: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    # The largest step the engine is sized for (memory profile, CUDA graphs).
    max_num_seqs: int
    max_num_batched_tokens: int
    # Ranks per pipeline stage, and stages: the scheduler keeps up to pipeline_parallel_size
    # steps in flight, holding disjoint requests.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Speculative decoding: how the engine proposes tokens ("" for none), and at most how many
    # per request and step (the scheduler's lookahead slots).
    speculative_method: str = ""
    num_speculative_tokens: int = 0
    # The window when every layer is windowed (0: none): the scheduler releases a request's
    # blocks wholly before it.
    sliding_window: int = 0
    # LoRA: device slots for adapters (at most this many distinct adapters per step; 0: none)
    # and the highest rank accepted.
    max_loras: int = 0
    max_lora_rank: int = 0
    # KV offload: the host and disk tiers' slots, one block each (0: no such tier).
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    kv_block_bytes: int = 0
    # Disaggregation (--engine-role): prefill, decode or both; where a decode engine takes KV
    # transfers (host:port; "" otherwise).
    engine_role: str = "both"
    kv_transfer_address: str = ""


_NEW_REQUEST_DOC = """A new request: engine.proto's NewRequest, field for field (seq_id, token_ids,
num_prompt_tokens, sampling, block_table, num_computed_tokens, num_scheduled_tokens, given; then
lora_slot, 0 by default: the base model)."""

_RUNNING_DOC = """The running rows: one column per field of engine.proto's RunningColumns (seq_ids,
num_scheduled_tokens, num_computed_tokens, num_new_blocks, new_block_ids, num_lookahead_tokens,
...), read by the rules of common/plan_columns.py: row i's new blocks are
new_block_ids[sum(num_new_blocks[:i]) : sum(num_new_blocks[:i+1])]; a column not given is empty,
and `column` reads an empty one other than the core ones as 0 per row (speculative decoding's
num_lookahead_tokens: KV slots row i may fill with tokens the engine proposes)."""


def _column(running: RunningData, name: str) -> list[int]:
    """RunningData.column: the column name, or 0 per row when it is an optional one left empty
    (common/plan_columns.py)."""
    column = getattr(running, name)
    if not column and name in OPTIONAL_COLUMNS:
        return [0] * len(running.seq_ids)
    return column


# NewRequest's fields up to this number are always given; later ones (scalars: lora_slot) default
# to the .proto's default.
_NEW_REQUEST_REQUIRED = 7

# The plan's two row shapes are dataclasses made from the .proto's descriptor (fields named and
# ordered as the messages'), so that a field added to the .proto needs no code here: mypy sees
# the stand-ins below.
if TYPE_CHECKING:

    class NewRequestData:
        FIELDS: tuple[str, ...]

        def __init__(self, *values: Any, **named: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...

    class RunningData:
        FIELDS: tuple[str, ...]

        def __init__(self, *columns: list[int], **named: list[int]) -> None: ...
        def __getattr__(self, name: str) -> list[int]: ...
        def column(self, name: str) -> list[int]: ...

else:
    NewRequestData = make_dataclass(
        "NewRequestData",
        [
            (f.name, Any)
            if f.number <= _NEW_REQUEST_REQUIRED
            else (f.name, Any, field(default=f.default_value))
            for f in engine_pb2.NewRequest.DESCRIPTOR.fields
        ],
        namespace={"__doc__": _NEW_REQUEST_DOC, "__module__": __name__},
    )
    RunningData = make_dataclass(
        "RunningData",
        [(name, list[int], field(default_factory=list)) for name in COLUMNS],
        namespace={
            "__doc__": _RUNNING_DOC,
            "__module__": __name__,
            "column": _column,
        },
    )
    NewRequestData.FIELDS = tuple(f.name for f in fields(NewRequestData))
    RunningData.FIELDS = COLUMNS


@dataclass(frozen=True)
class LoraLoadData:
    """engine.proto's LoraLoad: put adapter lora_name (read from path, or from the host cache)
    in device slot `slot` (1 .. max_loras) before the plan's rows run."""

    slot: int
    lora_name: str
    path: str = ""


@dataclass
class BlockCopiesData:
    """engine.proto's BlockCopies: block src_ids[i] of src_tier to slot dst_ids[i] of dst_tier
    (tiers as engine_pb2.KVTier values). A plan's batches run in list order before its forward:
    copies out of the pool finish before the forward writes it; copies into the pool fill
    blocks only a later plan's rows read (engine/kv_offload.py)."""

    src_tier: int
    dst_tier: int
    src_ids: list[int]
    dst_ids: list[int]


@dataclass(frozen=True)
class GrammarCompileData:
    """engine.proto's GrammarCompile: compile waiting request seq_id's constraint
    (common.proto's StructuredOutput) and report it compiled (StepOutput.compiled_seq_ids)."""

    seq_id: int
    structured_output: Any


@dataclass(frozen=True)
class KVSendData:
    """engine.proto's KVSend: read block_ids out of the pool before the forward, push them to
    the decode engine at address under transfer_id (engine/disaggregation.py)."""

    transfer_id: int
    block_ids: list[int]
    address: str


@dataclass(frozen=True)
class KVReceiveData:
    """engine.proto's KVReceive: when transfer_id arrives whole, write it into block_ids (at a
    plan's launch or as a step's result is produced) and report it in the first result after
    (StepOutput.received_transfer_ids)."""

    transfer_id: int
    block_ids: list[int]


@dataclass
class StepPlanData:
    step_id: int
    finished_seq_ids: list[int]
    new_requests: list[NewRequestData]
    running: RunningData = field(default_factory=RunningData)
    # LoRA: adapters placed in slots before the rows run; each row's slot is NewRequest /
    # RunningColumns `lora_slot` (0: the base model).
    lora_loads: list[LoraLoadData] = field(default_factory=list)
    # KV offload: copies between tiers, run in order before the forward (engine/kv_offload.py).
    kv_copies: list[BlockCopiesData] = field(default_factory=list)
    # Structured output: waiting requests' grammars to compile (engine/grammar.py).
    grammar_compiles: list[GrammarCompileData] = field(default_factory=list)
    # Disaggregation: KV transfers to send, to await, and awaited ones given up (cancels run
    # first, sends read the pool before the forward: engine/disaggregation.py).
    kv_sends: list[KVSendData] = field(default_factory=list)
    kv_receives: list[KVReceiveData] = field(default_factory=list)
    kv_receive_cancels: list[int] = field(default_factory=list)


@dataclass
class StepOutput:
    """One step's results, per plan row (new requests first, then running ones): one token each,
    or num_sampled_tokens[i] for row i when that is not empty (speculative decoding: the accepted
    proposals, then the token sampled after them). Per-token columns (logprobs, top logprob
    counts) follow sampled_token_ids."""

    sampled_token_ids: list[int]  # -1 where the request is mid-prefill
    # The chosen tokens' logprobs, NaN on rows that did not ask (or sampled nothing); None when
    # no row asked.
    logprobs: list[float] | None
    forward_ms: float
    sample_ms: float
    # When a row asked for top logprobs: how many each token returns (its request's top_logprobs,
    # 0 where it sampled nothing), and those entries, token after token, most likely first.
    num_top_logprobs: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    # Requests the engine refused (new ones it cannot run): ids and why. Their rows sample nothing.
    refused_seq_ids: list[int] = field(default_factory=list)
    refusal_reasons: list[str] = field(default_factory=list)
    # Speculative decoding, per row when any row had lookahead slots (else empty): tokens the
    # engine proposed, and tokens the row returns (accepted proposals + 1).
    num_draft_tokens: list[int] = field(default_factory=list)
    num_sampled_tokens: list[int] = field(default_factory=list)
    # Waiting requests whose grammar (an earlier plan's grammar_compiles) is compiled now.
    compiled_seq_ids: list[int] = field(default_factory=list)
    # Requests whose grammar allowed no token since the last result (EOS forced): each once.
    dead_end_seq_ids: list[int] = field(default_factory=list)
    # Disaggregation: awaited KV transfers written into the pool since the last result (at a
    # plan's launch, or as this result was produced: engine/disaggregation.py), each once.
    received_transfer_ids: list[int] = field(default_factory=list)
    # Awaited KV transfers whose connection failed since the last result (the scheduler gives
    # them up at once).
    failed_transfer_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Refusal:
    """A plan row the engine does not run: a new request it refused (reason), or a later row of
    one (reason None: reported already)."""

    row: int
    seq_id: int
    reason: str | None


def with_refused_rows(output: StepOutput, refusals: list[Refusal]) -> StepOutput:
    """output (one row per batch row) with the refused rows put back at their plan rows: no
    token, NaN logprob, no top logprobs; the refusals with a reason listed."""
    if not refusals:
        return output
    tokens, logprobs = list(output.sampled_token_ids), output.logprobs
    counts = list(output.num_top_logprobs)
    drafts, num_sampled = list(output.num_draft_tokens), list(output.num_sampled_tokens)
    for refusal in sorted(refusals, key=lambda r: r.row):
        at = refusal.row if not num_sampled else sum(num_sampled[: refusal.row])
        tokens.insert(at, -1)
        if logprobs is not None:
            logprobs = [*logprobs[:at], math.nan, *logprobs[at:]]
        if counts:
            counts.insert(at, 0)
        if num_sampled:
            num_sampled.insert(refusal.row, 1)
            drafts.insert(refusal.row, 0)
    refused = [r for r in refusals if r.reason is not None]
    return StepOutput(
        tokens, logprobs, output.forward_ms, output.sample_ms, counts,
        output.top_token_ids, output.top_logprobs,
        [r.seq_id for r in refused], [r.reason or "" for r in refused], drafts, num_sampled,
    )  # fmt: skip
