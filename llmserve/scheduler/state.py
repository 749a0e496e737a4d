"""The state every part of the scheduler reads and writes: its limits, queues, block manager,
counters and tenant ledger, and how a request ends (`_finish`). Scheduler (scheduler/scheduler.py)
is this state with its parts: planning, pipeline slots (scheduler/pipeline.py), preemption
(scheduler/policies/base.py) and step results (scheduler/results.py)."""

from __future__ import annotations

from collections import deque

from llmserve.scheduler.admin import SchedulerCounters
from llmserve.scheduler.block_manager import BlockManager
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.grammar_wait import GrammarWait
from llmserve.scheduler.kv_offload import KVOffload
from llmserve.scheduler.lora import LoraTable
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.speculation import SpeculationPolicy
from llmserve.scheduler.tenants import TenantLedger
from llmserve.scheduler.disagg.transfers import TransferTable


class SchedulerState:
    """What Scheduler and its parts share (scheduler/scheduler.py documents the whole)."""

    def __init__(
        self,
        config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        *,
        pipeline_parallel_size: int = 1,
        num_speculative_tokens: int = 0,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
        kv_block_bytes: int = 0,
    ):
        """num_speculative_tokens: the most tokens the engine proposes per request and step
        (speculative decoding; 0: none). With it, plan one step at a time (no overlap: a step's
        number of tokens per request is known only from its result). num_host_blocks,
        num_disk_blocks: the engine's KV offload tiers (0: none; scheduler/kv_offload.py), of
        blocks of kv_block_bytes each."""
        assert config.max_num_seqs > 0 and config.max_num_batched_tokens > 0, (
            "a scheduler needs its step limits: SchedulerConfig.adopt the engine's first"
        )
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.set_offload_tiers(num_host_blocks, num_disk_blocks, kv_block_bytes)
        self.waiting: deque[Request] = deque()
        # Constrained requests whose grammar the engine has not compiled yet (they join
        # `waiting` once it has; scheduler/grammar_wait.py).
        self.grammar_wait = GrammarWait()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        # Requests the engine mirrors that it must drop before the next plan.
        self.finished_seq_ids: list[int] = []
        # Requests preempted since the last plan was made (they travel in the next plan).
        self.preempted: list[Request] = []
        self.next_step_id = 1
        # The newest step whose result `update` applied (or whose result reset_engine lost).
        self.last_result_step_id = 0
        self.pipeline_parallel_size = 1
        self.set_pipeline_parallel_size(pipeline_parallel_size)
        self.speculation = SpeculationPolicy(0)
        self.set_num_speculative_tokens(num_speculative_tokens)
        self.counters = SchedulerCounters()
        self.tenants = TenantLedger(config.fair_prefill_weight, config.fair_decode_weight)
        # LoRA adapters: the registry and the engine's slot table (scheduler/lora.py); no slots
        # until an engine reports max_loras.
        self.loras = LoraTable()
        # Prefill / decode disaggregation: this scheduler's role and its transfers
        # (scheduler/disagg/handoffs.py); role "both" (colocated) uses none of it.
        self.transfers = TransferTable("both", config.kv_transfer_timeout_s)

    def set_sliding_window(self, sliding_window: int | None) -> None:
        """Release running requests' blocks that fall out of this window (the engine's, when
        every layer of its model has it; None: never). Only with nothing running."""
        assert not self.running, "set_sliding_window with running requests"
        self.block_manager.sliding_window = sliding_window or None

    def set_num_speculative_tokens(self, num_speculative_tokens: int) -> None:
        """Give decode steps up to num_speculative_tokens lookahead slots from the next plan on.
        Raises ValueError with P > 1 pipeline stages (refused: a stage's step would wait for the
        previous one's token counts) or a negative count."""
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be >= 0")
        if num_speculative_tokens and self.pipeline_parallel_size > 1:
            raise ValueError(
                f"speculative decoding needs pipeline_parallel_size=1, not "
                f"{self.pipeline_parallel_size}"
            )
        self.speculation = SpeculationPolicy(num_speculative_tokens)

    def set_pipeline_parallel_size(self, pipeline_parallel_size: int) -> None:
        """Plan for an engine of pipeline_parallel_size stages from the next step on. A change
        only while nothing runs (at start, or after reset_engine): running requests hold slots.
        Raises ValueError for a size below 1."""
        if pipeline_parallel_size < 1:
            raise ValueError(f"pipeline_parallel_size={pipeline_parallel_size} must be >= 1")
        if pipeline_parallel_size != self.pipeline_parallel_size:
            assert not self.running, "pipeline_parallel_size changed with running requests"
        self.pipeline_parallel_size = pipeline_parallel_size

    def set_offload_tiers(
        self, num_host_blocks: int, num_disk_blocks: int, block_bytes: int = 0
    ) -> None:
        """Index an engine's KV offload tiers of these sizes (0 host blocks: none; block_bytes:
        one block's size, for the byte counts) from the next plan on. Only while nothing is
        pinned (at start, or after reset_engine). Offload needs the prefix cache: without it,
        none. Tiers of the same sizes keep their counters (their contents were forgotten by
        reset_engine)."""
        bm = self.block_manager
        assert not bm.pins, "offload tiers changed with blocks pinned"
        old = bm.offload
        sizes = (num_host_blocks, num_disk_blocks)
        if old is not None and (old.host.num_slots, old.disk.num_slots if old.disk else 0) == sizes:
            old.block_bytes = block_bytes
            return
        offload = None
        if num_host_blocks > 0 and bm.enable_prefix_caching:
            offload = KVOffload(num_host_blocks, num_disk_blocks, block_bytes)
        bm.offload = offload

    def _finish(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished
        request.status = status
        request.num_pending_tokens = 0  # results still in flight for it are ignored
        self.block_manager.unpin(request.seq_id)  # a swap-in it was waiting for
        self.block_manager.free(request)
        del self.requests[request.seq_id]
        self.tenants.leave(request.tenant)
        self._drop_from_engine(request)
        self.counters.num_finished_requests += 1
        reasons = self.counters.finish_reasons
        reasons[status.value] = reasons.get(status.value, 0) + 1

    def _drop_from_engine(self, request: Request) -> None:
        """If the engine's mirror holds request, list it for the next plan to drop."""
        if request.mirror.in_engine:
            self.finished_seq_ids.append(request.seq_id)
            request.mirror.in_engine = False

    @property
    def has_work(self) -> bool:
        """Whether to plan a step: requests to run or drop, or grammars to compile or to ask
        the engine about, or KV transfers under way."""
        return bool(
            self.waiting or self.running or self.finished_seq_ids or self.grammar_wait
            or self.transfers.has_work
        )  # fmt: skip

    @property
    def num_waiting(self) -> int:
        """Requests not running: in the waiting line, or held for their grammar."""
        return len(self.waiting) + len(self.grammar_wait)

    def grammars_compiled(self, seq_ids: list[int]) -> None:
        """The engine compiled the grammars of these held requests (a result's
        compiled_seq_ids): they join the waiting line. Unknown ids are ignored."""
        self.waiting.extend(self.grammar_wait.release(seq_ids))

    def grammar_dead_ends(self, seq_ids: list[int]) -> None:
        """The engine found these requests' constraints at a dead end (a result's
        dead_end_seq_ids): each ends at its next token, with that finish reason. Unknown ids (a
        request ended since) are ignored."""
        for seq_id in seq_ids:
            if (request := self.requests.get(seq_id)) is not None:
                request.grammar_dead_end = True

    def _is_padding(self, request: Request) -> bool:
        """Whether request runs on without streaming (hook; static batching's padding rows)."""
        return False
