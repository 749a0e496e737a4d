"""A request as the scheduler tracks it, from admission to its last token."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from llmserve.common.block_hash import lora_hash_root
from llmserve.protos.common_pb2 import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_GRAMMAR_DEAD_END = "grammar_dead_end"  # its constraint allowed no further token

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


@dataclass
class PreemptionRecord:
    """Bounded preemption (scheduler/policies/base.py): the id of the step that last admitted the
    request (0: never admitted), which spares it for preemption_grace_steps steps after, and why
    it was last preempted."""

    admitted_step_id: int = 0
    reason: str = ""


@dataclass
class LedgerEntry:
    """The fair-share ledger (scheduler/tenants.py): positions [0, num_charged_tokens) were
    charged to the request's tenant's virtual token counter; a recompute is not charged again."""

    num_charged_tokens: int = 0


@dataclass
class MirrorState:
    """What the engine's mirror holds of the request: whether it knows it, and how many of its
    blocks."""

    in_engine: bool = False
    num_sent_blocks: int = 0


@dataclass
class PipelinePlace:
    """Pipeline parallelism (scheduler/pipeline.py): the slot whose steps the request runs in
    while running (None while waiting), and the id of the last step that scheduled it (0: none
    yet)."""

    slot: int | None = None
    last_step_id: int = 0


@dataclass
class SpecState:
    """Speculative decoding: the lookahead slots the plan being made gives the request, and the
    back-off policy's state (scheduler/speculation.py)."""

    num_lookahead_tokens: int = 0
    acceptance: float = 1.0
    backoff_steps: int = 0
    steps_to_skip: int = 0


@dataclass
class PromptScore:
    """One prompt token's score (prompt logprobs): its logprob, its rank (1: the most likely) and
    the most likely tokens at its position when the request asked for some."""

    logprob: float
    rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Request:
    """One generation. `token_ids` is the prompt followed by every token generated so far.

        token_ids:  |<- prompt ->|<- output ->|
        num_tokens: |<- token_ids ----------->|<- pending ->|
        KV pool:    |<- num_computed_tokens ->|<- not yet computed ->|

    `num_computed_tokens` advances when a step is planned, so a running request always has at
    least one token left to compute: its newest sampled token, or the rest of its prompt.
    A planned step that will sample for the request adds a pending token, a placeholder for the
    token not known yet: the next step can be planned before the result arrives (overlap), the
    placeholder standing in as that step's input. The result replaces it with the real token.
    """

    request_id: str
    seq_id: int
    prompt_token_ids: list[int]
    # Passed to the engine as it came (normalized by common.sampling); the scheduler never reads it.
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Chained content hashes of the full blocks of token_ids, filled lazily by the block manager.
    block_hashes: list[int] = field(default_factory=list)
    # Leading block_table entries released because they fell out of a sliding window: still
    # listed (the engine's mirror keeps them), no longer held (scheduler/block_manager.py).
    num_released_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Prompt tokens found in the prefix cache at first admission (None until admitted).
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    # Who sent it, that tenant's weight under the fair policy (> 0), and its priority under the
    # priority policy (lower runs first).
    tenant: str = ""
    tenant_weight: float = 1.0
    priority: int = 0
    # Tokens sampled by steps planned but whose results have not arrived (0, 1, or 2 with overlap).
    num_pending_tokens: int = 0
    # The client turned speculative decoding off for it.
    disable_speculation: bool = False
    # The LoRA adapter it runs under ("": the base model), and the key of the version it was
    # admitted under (scheduler/lora.py), which it keeps to the end. Its prefix-cache blocks are
    # keyed by that version (common/block_hash.py: the chain starts from the key's root).
    lora_name: str = ""
    lora_key: str = ""
    # The engine reported its output constraint at a dead end (it forced EOS): it ends with
    # FINISHED_GRAMMAR_DEAD_END at its next token.
    grammar_dead_end: bool = False
    # Hybrid linear-attention models: the engine's state slot it holds while running
    # (scheduler/state_slots.py; None: none).
    state_slot: int | None = None
    # The snapshot slot its state is restored from when admitted on a prefix-cache hit (0: none).
    state_restore_from: int = 0
    # Where its cached prefix ends when no snapshot reaches that far (0: none): a block end its
    # prefill stops at to leave a snapshot there (StateSnapshots.cap_hit).
    state_junction: int = 0
    # Prompt logprobs asked (with prompt_top_logprobs alternatives each), and the scores the
    # engine returned so far: prompt_scores[j] is prompt token j + 1's. Until all are in, the
    # prompt is computed whole (no prefix-cache hit) and without lookahead slots.
    prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    prompt_scores: list[PromptScore] = field(default_factory=list)
    # KV offload: when it began waiting for its prefix to come back from a lower tier (0: not).
    swap_in_since: float = 0.0
    # Each feature's state, in its own record.
    preemption: PreemptionRecord = field(default_factory=PreemptionRecord)
    ledger: LedgerEntry = field(default_factory=LedgerEntry)
    mirror: MirrorState = field(default_factory=MirrorState)
    pipeline: PipelinePlace = field(default_factory=PipelinePlace)
    spec: SpecState = field(default_factory=SpecState)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def block_hash_root(self) -> int:
        """The parent hash of its first block: 0 for the base, its adapter version's root else
        (the name's until admission sets the version)."""
        return lora_hash_root(self.lora_key or self.lora_name)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending ones: the length steps are planned against."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some have not come back yet."""
        return self.prompt_logprobs and len(self.prompt_scores) < self.num_prompt_tokens - 1

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens known so far (pending ones not counted)."""
        return len(self.token_ids) - len(self.prompt_token_ids)
