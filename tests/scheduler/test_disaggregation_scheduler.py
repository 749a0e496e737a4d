"""Prefill / decode disaggregation as the scheduler plans it (torch-free): a prefill Scheduler and
a decode Scheduler, the handoff between them as the service makes it, and a fake engine on each
side. Exact block ids in the sends and receives, the first token streamed once, the decode side's
prefix hit on the blocks moved, and every failure path (deadline, an engine lost, a cancel)
leaving no block held on either side."""

from __future__ import annotations

import os
import time

import pytest

from llmserve.common.step_plan import KVReceive, KVSend
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import PromptScoreColumns, StepOutcome, StepPlan, take_prompt_scores
from llmserve.scheduler.request import Request, RequestStatus
from llmserve.scheduler.scheduler import Scheduler
from tests.factories import sampling

BS = 4
ADDRESS = "127.0.0.1:9"


def make(role: str, num_blocks: int = 16, budget: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4, kv_transfer_timeout_s=1)
    s = Scheduler(config, num_blocks, BS, 256, 1000, (999,))
    s.transfers.role = role
    return s


def request(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(f"r{seq_id}", seq_id, prompt, sampling(), max_tokens, ignore_eos=True)


def step(s: Scheduler, token: int = 7, received: list[int] | None = None) -> tuple[StepPlan, list]:
    """Plan a step and apply the fake engine's result (token for every sampling row, the
    transfers it reports received)."""
    plan = s.schedule()
    outcomes = s.update(plan, [token if row.samples else -1 for row in plan.rows])
    if received:
        s.handoffs.on_received(received)
    s.check_integrity()
    return plan, outcomes


def hand_off(prefill: Scheduler, decode: Scheduler) -> list[int]:
    """What the service does after a prefill result: each handoff to the decode side, its send
    queued on the prefill side. Returns the transfer ids started."""
    ids = []
    for req, blocks in prefill.handoffs.take():
        to_send = decode.handoffs.receive(req, blocks)
        if to_send:
            ids.append(decode.transfers.by_seq_id[req.seq_id])
            prefill.handoffs.queue_send(ids[-1], to_send, ADDRESS)
    return ids


def prefill_one(prefill: Scheduler, decode: Scheduler, req: Request) -> tuple[list, list[int]]:
    """Run req's prompt on the prefill side to its first token; hand it off."""
    prefill.add(req)
    outcomes: list[StepOutcome] = []
    while prefill.running or prefill.waiting:
        outcomes += step(prefill, token=50)[1]
    return outcomes, hand_off(prefill, decode)


def assert_no_block_held(*schedulers: Scheduler) -> None:
    for s in schedulers:
        s.check_integrity()
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
        assert not s.block_manager.pins and not s.requests


def test_a_prompt_moves_its_full_blocks_and_decodes_on_a_prefix_hit() -> None:
    prefill, decode = make("prefill"), make("decode")
    req = request(1, list(range(10, 20)))  # 10 tokens: 2 full blocks + 2 tokens
    outcomes, (tid,) = prefill_one(prefill, decode, req)
    assert [o.token_id for o in outcomes] == [50]  # streamed once, by the prefill side
    p_table = prefill.block_manager  # freed, but kept in the prefill pool's prefix cache
    assert p_table.num_free_blocks == 16 and len(p_table.hash_to_block) == 2
    send_plan, _ = step(prefill)
    assert send_plan.kv_sends == [KVSend(tid, [0, 1], ADDRESS)] and not send_plan.rows
    receive_plan, _ = step(decode)
    transfer_blocks = decode.transfers.in_flight[tid].block_ids
    assert receive_plan.kv_receives == [KVReceive(tid, transfer_blocks)]
    assert receive_plan.awaits_transfers
    assert not receive_plan.rows and decode.has_work  # polled until the transfer is in
    step(decode, received=[tid])
    plan, outcomes = step(decode, token=60)
    (row,) = plan.new_requests
    # A prefix hit on the moved blocks: computes the partial block and the first token.
    assert row.block_table[:2] == transfer_blocks and row.num_computed_tokens == 8
    assert row.token_ids == [*range(10, 20), 50] and row.num_scheduled_tokens == 3
    assert [o.token_id for o in outcomes] == [60]  # the second token, the first not again
    while decode.has_work:
        step(decode)
    assert req.token_ids[10:] == [50, 60, 7, 7] and req.status == RequestStatus.FINISHED_LENGTH
    assert decode.transfers.counters.num_done == 1 and decode.transfers.counters.num_blocks == 2
    assert_no_block_held(decode)


def test_prompt_logprobs_are_scored_on_the_prefill_side_only() -> None:
    """A request asking prompt logprobs runs its whole prompt on the prefill side (in chunks),
    where its scores come back with its first token; the decode side, with every score in,
    neither asks the engine again nor skips its prefix hit on the blocks moved."""
    prefill, decode = make("prefill"), make("decode")
    req = request(1, list(range(10, 20)))
    req.prompt_logprobs = True
    prefill.add(req)
    while prefill.running or prefill.waiting:
        plan = prefill.schedule()
        (row,) = plan.rows
        assert getattr(row, "prompt_logprobs", True)  # a new row asks; the mirror keeps it
        start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_scheduled_tokens
        n = min(end, 9) - start  # positions predicting prompt tokens 1 .. 9
        scores = [-float(p + 1) for p in range(start, start + n)]
        take_prompt_scores(plan, PromptScoreColumns([n], scores, [1] * n, [], []))
        prefill.update(plan, [50 if row.samples else -1])
    assert [s.logprob for s in req.prompt_scores] == [-float(j) for j in range(1, 10)]
    (tid,) = hand_off(prefill, decode)
    step(prefill)
    step(decode)
    step(decode, received=[tid])
    plan, _ = step(decode, token=60)
    (row,) = plan.new_requests
    assert not row.prompt_logprobs and row.num_computed_tokens == 8
    while decode.has_work:
        step(decode)
    assert_no_block_held(prefill, decode)


def test_only_what_the_decode_prefix_cache_lacks_moves() -> None:
    prefill, decode = make("prefill"), make("decode")
    for seq_id, prompt in ((1, [*range(10, 18), 1, 2, 3, 4, 5]), (2, [*range(10, 18), 6, 7, 8, 9])):
        _, tids = prefill_one(prefill, decode, request(seq_id, prompt))
        plan, _ = step(prefill)
        sent = plan.kv_sends[0].block_ids
        step(decode)
        step(decode, received=tids)
        while decode.has_work:
            step(decode)
    # The second prompt's first two blocks were on the decode side already: only its third moved.
    assert len(sent) == 1 and decode.transfers.counters.num_blocks == 3 + 1
    assert_no_block_held(decode)


def test_a_transfer_past_its_deadline_recomputes_on_the_decode_side() -> None:
    prefill, decode = make("prefill"), make("decode")
    req = request(1, list(range(10, 22)))
    _, (tid,) = prefill_one(prefill, decode, req)
    step(decode)
    decode.transfers.in_flight[tid].deadline = time.monotonic() - 1
    plan, outcomes = step(decode, token=60)
    assert plan.kv_receive_cancels == [tid] and not plan.awaits_transfers
    (row,) = plan.new_requests  # recomputed whole: no block of the transfer was cached
    assert row.num_computed_tokens == 0 and row.num_scheduled_tokens == 8
    outcomes += step(decode, token=60, received=[tid])[1]  # arriving after all: ignored
    while decode.has_work:
        outcomes += step(decode, token=60)[1]
    assert [o.token_id for o in outcomes] == [60, 60, 60] and req.num_output_tokens == 4
    assert decode.transfers.counters.num_failed["deadline"] == 1
    assert_no_block_held(decode)


def test_a_cancel_mid_transfer_frees_both_sides() -> None:
    prefill, decode = make("prefill"), make("decode")
    req = request(1, list(range(10, 22)))
    _, (tid,) = prefill_one(prefill, decode, req)
    step(decode)
    for s in (prefill, decode):  # what the service does when the client goes away
        s.abort(req.seq_id)
    plan, _ = step(decode)
    assert plan.kv_receive_cancels == [tid] and not decode.has_work
    assert decode.transfers.counters.num_failed["cancelled"] == 1
    step(prefill)  # the send goes out all the same; the receiver drops it
    assert_no_block_held(prefill, decode)


def test_losing_the_decode_engine_fails_its_transfers_into_recompute() -> None:
    prefill, decode = make("prefill"), make("decode")
    req = request(1, list(range(10, 22)))
    assert len(prefill_one(prefill, decode, req)[1]) == 1
    step(decode)
    decode.reset_engine()
    assert decode.transfers.counters.num_failed["decode_lost"] == 1 and decode.waiting[0] is req
    plan, _ = step(decode)
    assert not plan.kv_receive_cancels  # a new engine stream never heard of it
    assert plan.new_requests[0].num_computed_tokens == 0
    while decode.has_work:
        step(decode)
    assert req.num_output_tokens == 4
    assert_no_block_held(decode)


def test_the_prefill_side_never_plans_past_the_first_token() -> None:
    prefill = make("prefill", budget=64)
    req = request(1, list(range(10, 22)))
    prefill.add(req)
    first = prefill.schedule()  # the whole prompt: it samples the first token
    ahead = prefill.schedule()  # planned before the result (overlap): nothing for it
    assert first.rows[0].samples and not ahead.rows
    prefill.update(first, [50])
    prefill.update(ahead, [])
    assert not prefill.running and len(prefill.handoffs.take()) == 1
    prefill.check_integrity()


def test_serve_flags_make_a_prefill_and_a_decode_engine() -> None:
    from llmserve.serve_flags import parse_serve_flags, stack_from_flags

    args = ["--device", "cpu", "--port", "1", "--scheduler-port", "2", "--engine-port", "3"]
    stack = stack_from_flags(
        parse_serve_flags([*args, "--prefill-engines", "1", "--decode-engines", "1"])
    )
    assert stack.prefill_engine is not None and stack.prefill_engine.engine_role == "prefill"
    assert stack.engine.engine_role == "decode"
    assert stack.prefill_engine.max_loras == stack.engine.max_loras > 0  # adapters on both
    assert stack.scheduler.prefill_engine_address == (f"127.0.0.1:{stack.prefill_engine.port}",)
    assert stack.scheduler.engine_address == ("127.0.0.1:3",)
    assert "engine-prefill" in stack.service_names()
    for roles in (["--prefill-engines", "1"], ["--decode-engines", "2"]):
        with pytest.raises(ValueError, match="both at least 1"):
            stack_from_flags(parse_serve_flags([*args, *roles]))


def test_serve_flags_make_n_prefill_and_m_decode_engines() -> None:
    from llmserve.serve_flags import parse_serve_flags, stack_from_flags

    args = ["--device", "cpu", "--port", "1", "--scheduler-port", "2", "--engine-port", "3"]
    flags = [*args, "--metrics-port", "9000", "--prefill-engines", "2", "--decode-engines", "3"]
    stack = stack_from_flags(parse_serve_flags(flags))
    names = stack.service_names()
    engines = [n for n in names if n.startswith("engine")]
    assert engines == [
        "engine", "engine-prefill", "engine-prefill-2", "engine-decode-2", "engine-decode-3"
    ]  # fmt: skip
    configs = [stack.config_of(n) for n in engines]
    roles = [c.engine_role for c in configs]
    assert roles == ["decode", "prefill", "prefill", "decode", "decode"]
    s = stack.scheduler
    assert s.engine_address == tuple(
        f"127.0.0.1:{c.port}" for c in configs if c.engine_role == "decode"
    )
    assert s.prefill_engine_address == tuple(f"127.0.0.1:{c.port}" for c in configs[1:3])
    assert s.engine_address[0] == "127.0.0.1:3"
    # Every engine its own port and metrics port (after the gateway, scheduler, first engine's).
    assert len({c.port for c in configs}) == 5
    assert sorted(c.metrics_port for c in configs) == [9002, 9003, 9004, 9005, 9006]
    # On a CPU the cores are shared among the five (at least one thread each).
    assert all(c.num_threads == max(1, (os.cpu_count() or 1) // 5) for c in configs)


def test_decode_engines_speculate_by_ngrams_only() -> None:
    from llmserve.engine.config import EngineConfig
    from llmserve.serve_flags import parse_serve_flags, stack_from_flags

    spec = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]
    args = ["--device", "cpu", "--prefill-engines", "1", "--decode-engines", "2", *spec]
    stack = stack_from_flags(parse_serve_flags(args))
    assert [e.speculative_method for e in stack.prefill_engines] == ["none"]
    decodes = [stack.engine, *stack.decode_engines]
    assert [(e.speculative_method, e.num_speculative_tokens) for e in decodes] == [("ngram", 3)] * 2
    with pytest.raises(ValueError, match="draft model's KV does not move"):
        EngineConfig(engine_role="decode", speculative_method="draft", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="samples one token"):
        EngineConfig(engine_role="prefill", speculative_method="ngram", num_speculative_tokens=2)


def test_each_prefill_and_decode_engine_gets_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPUs, `serve --prefill-engines 2 --decode-engines 2` puts each engine on a GPU of its
    own: the first decode engine on the first (it sees them all, as replica 0 does), the
    others on the next ones of CUDA_VISIBLE_DEVICES, in service order."""
    from llmserve.serve_flags import parse_serve_flags, stack_from_flags
    from llmserve.topology import role_engine_gpu

    args = ["--device", "cuda", "--prefill-engines", "2", "--decode-engines", "2"]
    stack = stack_from_flags(parse_serve_flags(args))
    names = ["engine-prefill", "engine-prefill-2", "engine-decode-2"]
    assert list(stack._role_engines()) == names
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    gpus = [stack.env_of(name).get("CUDA_VISIBLE_DEVICES") for name in ["engine", *names]]
    assert gpus == [None, "5", "6", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert role_engine_gpu(stack.engine, 2) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert role_engine_gpu(stack.engine, 0) == {}
    cpu = stack_from_flags(parse_serve_flags(["--device", "cpu", *args[2:]]))
    assert role_engine_gpu(cpu.engine, 1) == {}
