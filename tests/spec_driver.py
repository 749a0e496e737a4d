"""A scheduler and an engine (real or echo) in one process, one step at a time through the real
contract (protobuf both ways), as the service runs them with speculation: for the speculative
decoding tests and bench/studies/spec_cpu.py's offline checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmserve.engine.contract.convert import plan_from_proto, result_to_proto
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import apply_result, plan_to_proto


@dataclass
class Driven:
    """What a run produced: each request's tokens (and logprobs) by seq id, how each finished,
    and the steps it took."""

    outputs: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[float | None]] = field(default_factory=dict)
    finished: dict[int, RequestStatus] = field(default_factory=dict)
    num_steps: int = 0


def make_scheduler_for(engine: Any, **config: Any) -> Scheduler:
    """A continuous-batching scheduler for engine's EngineInfo (its speculation included)."""
    info = engine.info
    defaults = {"max_num_seqs": info.max_num_seqs, "max_num_batched_tokens": 256}
    return Scheduler(
        SchedulerConfig(**{**defaults, **config}),
        info.num_blocks,
        info.block_size,
        info.max_model_len,
        info.vocab_size,
        info.eos_token_ids,
        num_speculative_tokens=info.num_speculative_tokens,
    )


def check_mirror(scheduler: Scheduler, engine: Any) -> None:
    """The engine's mirror holds what the scheduler holds for every running request: tokens,
    computed tokens, block table (the lookahead blocks given back on both sides)."""
    for request in scheduler.running:
        seq = engine.mirror.seqs[request.seq_id]
        assert seq.token_ids == request.token_ids, request.request_id
        assert seq.num_computed_tokens == request.num_computed_tokens, request.request_id
        assert seq.block_table == request.block_table, request.request_id


def drive(
    scheduler: Scheduler, engine: Any, requests: list[Request], max_steps: int = 10_000
) -> Driven:
    """Add requests, run steps until the scheduler is idle; check the block manager and the
    mirror after every step, and that every block is free at the end."""
    for request in requests:
        scheduler.add(request)
    run = Driven()
    while scheduler.has_work:
        assert run.num_steps < max_steps, "the scheduler did not go idle"
        plan = scheduler.schedule()
        if plan.is_empty:
            continue
        run.num_steps += 1
        output = engine.step(plan_from_proto(plan_to_proto(plan)))
        result = result_to_proto(plan.step_id, output, 0.0)
        outcomes = apply_result(scheduler, plan, result)
        for o in outcomes:
            seq_id = o.request.seq_id
            assert seq_id not in run.finished, f"a token for {seq_id} after it finished"
            run.outputs.setdefault(seq_id, []).append(o.token_id)  # type: ignore[arg-type]
            run.logprobs.setdefault(seq_id, []).append(o.logprob)
            if o.finished is not None:
                run.finished[seq_id] = o.finished
        scheduler.check_integrity()
        check_mirror(scheduler, engine)
    scheduler.block_manager.check_integrity([])
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks still held when idle"
    return run
