"""engine.mirror.Mirror: the one-token rule and every way a plan can disagree with the mirror;
engine.fake.EchoEngine's echo.

Plans are built only by the factories below (new, running, plan), so a change to the plan
dataclasses is absorbed here and nowhere else."""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Sequence

import pytest

from llmserve.common.step_plan import NewRequest, RunningColumns, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.echo import EchoEngine, EchoEngineConfig
from llmserve.engine.contract.mirror import PLACEHOLDER, Mirror, MirrorMismatch
from tests.factories import sampling

BLOCK_SIZE = 4
NUM_BLOCKS = 16
SAMPLED = 100  # the token every committed sampling row appends in applied()


def new(
    seq_id: int,
    tokens: Sequence[int],
    blocks: Sequence[int],
    computed: int = 0,
    scheduled: int | None = None,
    prompt: int | None = None,
    logprobs: bool = False,
) -> NewRequest:
    """A new request; scheduled defaults to every token not computed yet, prompt (the number of
    prompt tokens) to all of them; greedy sampling."""
    return NewRequest(
        seq_id=seq_id,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens) if prompt is None else prompt,
        sampling=sampling(temperature=0.0, logprobs=logprobs),
        block_table=list(blocks),
        num_computed_tokens=computed,
        num_scheduled_tokens=len(tokens) - computed if scheduled is None else scheduled,
    )


def running(
    seq_ids: Sequence[int] = (),
    scheduled: Sequence[int] = (),
    computed: Sequence[int] = (),
    num_new_blocks: Sequence[int] | None = None,
    new_block_ids: Sequence[int] = (),
) -> RunningColumns:
    """The running rows, column by column as the plan carries them (columns of different
    lengths are allowed: they are a mismatch case); num_new_blocks defaults to 0 per row."""
    return RunningColumns(
        seq_ids=list(seq_ids),
        num_scheduled_tokens=list(scheduled),
        num_computed_tokens=list(computed),
        num_new_blocks=[0] * len(seq_ids) if num_new_blocks is None else list(num_new_blocks),
        new_block_ids=list(new_block_ids),
    )


def plan(
    step_id: int,
    finished: Sequence[int] = (),
    new: Sequence[NewRequest] = (),
    run: RunningColumns | None = None,
) -> StepPlanData:
    return StepPlanData(
        step_id=step_id,
        finished_seq_ids=list(finished),
        new_requests=list(new),
        running=running() if run is None else run,
    )


def prefill(num_tokens: int, seq_id: int = 1) -> StepPlanData:
    """Step 1: seq_id's whole prompt of num_tokens (0, 1, ...) in blocks 3, 4, ..."""
    blocks = range(3, 3 + -(-num_tokens // BLOCK_SIZE))
    return plan(1, new=[new(seq_id, range(num_tokens), blocks)])


def applied(*plans: StepPlanData) -> Mirror:
    """A mirror that applied and committed plans in order, each sampling row appending SAMPLED."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    for p in plans:
        batch = m.apply(p)
        m.commit(batch, [SAMPLED] * len(batch.rows))
    return m


def mirror_with_seq(seq_id: int = 1, num_tokens: int = 6) -> Mirror:
    """A mirror holding one request whose prompt of num_tokens is fully computed and which has
    appended sampled token SAMPLED (so it has num_tokens + 1 tokens, num_tokens computed)."""
    return applied(prefill(num_tokens, seq_id))


# ---- the one-token rule ----------------------------------------------------------------------


def test_new_request_row_covers_scheduled_tokens() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new(7, [10, 11, 12, 13, 14], [5, 2], computed=1, scheduled=3)]))
    assert batch.step_id == 1
    (row,) = batch.rows
    assert (row.seq.seq_id, row.start, row.end, row.num_scheduled_tokens) == (7, 1, 4, 3)
    assert not row.samples
    assert batch.num_tokens == 3
    assert m.seqs[7].block_table == [5, 2]


def test_commit_mid_prefill_discards_token_then_completion_appends() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    prompt = [10, 11, 12, 13, 14, 15, 16]
    batch = m.apply(plan(1, new=[new(1, prompt, [0, 1], scheduled=4)]))
    m.commit(batch, [99])
    seq = m.seqs[1]
    assert seq.token_ids == prompt  # mid-prefill: token discarded
    assert seq.num_computed_tokens == 4
    assert seq.num_output_tokens == 0

    batch = m.apply(plan(2, run=running([1], [3], [4])))
    (row,) = batch.rows
    assert (row.start, row.end, row.samples) == (4, 7, True)
    m.commit(batch, [42])
    assert seq.token_ids == [*prompt, 42]
    assert seq.num_computed_tokens == 7
    assert seq.num_output_tokens == 1

    # decode: one token, grows into a new block handed over as a delta
    batch = m.apply(plan(3, run=running([1], [1], [7], [1], [9])))
    assert seq.block_table == [0, 1, 9]
    (row,) = batch.rows
    assert (row.start, row.end, row.samples) == (7, 8, True)
    m.commit(batch, [43])
    assert seq.token_ids == [*prompt, 42, 43]
    assert seq.num_computed_tokens == 8
    assert seq.num_output_tokens == 2


def test_commit_pending_then_resolve_in_order() -> None:
    """Overlap: step 2 is applied and committed before step 1's token is known; the counts
    check out against placeholders, and each step's tokens land where its rows put them."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    prompt = [10, 11, 12, 13, 14, 15, 16]
    step1 = m.apply(plan(1, new=[new(1, prompt, [0, 1]), new(2, [5, 6], [2], scheduled=1)]))
    m.commit_pending(step1)
    seq = m.seqs[1]
    assert seq.token_ids == [*prompt, PLACEHOLDER]
    assert (seq.num_computed_tokens, seq.pending_step_id, seq.pending_row) == (7, 1, 0)
    assert m.seqs[2].token_ids == [5, 6]  # mid-prefill: no placeholder

    step2 = m.apply(plan(2, run=running([2, 1], [1, 1], [1, 7])))
    assert [(r.start, r.end, r.samples) for r in step2.rows] == [(1, 2, True), (7, 8, True)]
    m.commit_pending(step2)
    assert seq.token_ids == [*prompt, PLACEHOLDER, PLACEHOLDER]
    assert (seq.pending_step_id, seq.pending_row) == (2, 1)

    m.resolve(step1, [42, -1])
    assert seq.token_ids == [*prompt, 42, PLACEHOLDER]
    assert (seq.pending_step_id, seq.pending_row) == (2, 1)  # still step 2's
    m.resolve(step2, [7, 43])
    assert seq.token_ids == [*prompt, 42, 43]
    assert (seq.pending_step_id, seq.pending_row) == (0, -1)
    assert m.seqs[2].token_ids == [5, 6, 7]


def test_resolve_after_the_request_was_dropped() -> None:
    """A request that finished (or was preempted) while its step was unresolved: resolving
    touches only the dropped state, never a new request with the same id."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    step1 = m.apply(plan(1, new=[new(1, [1, 2, 3], [0])]))
    m.commit_pending(step1)
    m.apply(plan(2, finished=[1], new=[new(1, [1, 2, 3], [4])]))
    m.resolve(step1, [9])
    assert m.seqs[1].token_ids == [1, 2, 3]


def test_commit_rows_in_plan_order_new_first() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(2, new=[new(2, [1, 2, 3], [0])], run=running([1], [1], [6])))
    assert [r.seq.seq_id for r in batch.rows] == [2, 1]
    m.commit(batch, [50, 51])
    assert m.seqs[2].token_ids == [1, 2, 3, 50]
    assert m.seqs[1].token_ids == [0, 1, 2, 3, 4, 5, SAMPLED, 51]


def test_commit_requires_one_token_per_row() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new(1, [1, 2], [0])]))
    with pytest.raises(ValueError):
        m.commit(batch, [])


def test_new_request_with_generated_tokens_resumes_output_count() -> None:
    """A preempted request comes back with its generated tokens in token_ids."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new(1, [1, 2, 3, 7, 8], [0, 1], prompt=3)]))
    assert m.seqs[1].num_output_tokens == 2
    m.commit(batch, [9])
    assert m.seqs[1].token_ids == [1, 2, 3, 7, 8, 9]
    assert m.seqs[1].num_output_tokens == 3


def test_finished_dropped_before_new_so_an_id_can_come_back() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(2, new=[new(1, [5, 5], [4])], finished=[1]))
    assert m.seqs[1].token_ids == [5, 5]
    assert batch.rows[0].seq is m.seqs[1]


def test_empty_plan_gives_empty_batch() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(5, finished=[1]))
    assert batch.rows == []
    assert m.seqs == {}
    assert m.last_step_id == 5


def test_exactly_enough_blocks_is_fine() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new(1, range(8), [3, 2])]))
    assert batch.rows[0].end == 8


def test_last_valid_block_id_accepted() -> None:
    m = mirror_with_seq(1, 8)
    m.apply(plan(2, run=running([1], [1], [8], [1], [NUM_BLOCKS - 1])))
    assert m.seqs[1].block_table[-1] == NUM_BLOCKS - 1


def test_new_block_ids_split_by_count() -> None:
    m = applied(plan(1, new=[new(1, range(4), [0]), new(2, range(8), [1, 2])]))
    m.apply(plan(2, run=running([2, 1], [1, 1], [8, 4], [1, 2], [9, 5, 6])))
    assert m.seqs[2].block_table == [1, 2, 9]
    assert m.seqs[1].block_table == [0, 5, 6]


# ---- mismatches ------------------------------------------------------------------------------
# Each case: the plans to apply; all but the last are applied and committed (applied()), the
# last must raise MirrorMismatch with the message fragment. prefill(6) and prefill(8) (step 1)
# leave seq 1 with 6 (8) prompt tokens computed, in blocks [3, 4], and SAMPLED appended.

Plans = Callable[[], list[StepPlanData]]


def case(name: str, plans: Plans, fragment: str) -> object:
    return pytest.param(plans, fragment, id=name)


MISMATCHES = [
    # step ids
    case("step-id-repeated", lambda: [prefill(6), plan(1)], "step_id 1 after 1"),
    case("step-id-zero", lambda: [prefill(6), plan(0)], "step_id 0 after 1"),
    case("step-id-negative", lambda: [prefill(6), plan(-3)], "step_id -3 after 1"),
    # ids the mirror does not hold, or holds already
    case(
        "unknown-running-id",
        lambda: [prefill(6), plan(2, run=running([2], [1], [6]))],
        "running seq 2 is not in the mirror",
    ),
    case(
        "unknown-finished-id",
        lambda: [prefill(6), plan(2, finished=[3])],
        "finished seq 3 is not in the mirror",
    ),
    case(
        "finished-twice",
        lambda: [prefill(6), plan(2, finished=[1, 1])],
        "finished seq 1 is not in the mirror",
    ),
    case(
        "new-id-already-in-mirror",
        lambda: [prefill(6), plan(2, new=[new(1, [1, 2], [0])])],
        "new seq 1 is already in the mirror",
    ),
    case(
        "new-id-twice-in-plan",
        lambda: [plan(1, new=[new(4, [1, 2], [0]), new(4, [3], [1])])],
        "a seq id is listed twice in one plan",
    ),
    case(  # the same request scheduled twice would be computed (and committed) twice
        "running-id-twice-in-plan",
        lambda: [prefill(6), plan(2, run=running([1, 1], [1, 1], [6, 6]))],
        "a seq id is listed twice in one plan",
    ),
    case(
        "new-id-also-running",
        lambda: [plan(1, new=[new(1, [1, 2, 3], [0], scheduled=2)], run=running([1], [1], [0]))],
        "a seq id is listed twice in one plan",
    ),
    # computed tokens
    *(
        case(
            f"computed-{claimed}-not-6",
            lambda claimed=claimed: [prefill(6), plan(2, run=running([1], [1], [claimed]))],
            f"seq 1: plan says {claimed} computed tokens, mirror has 6",
        )
        for claimed in (5, 7, 0)
    ),
    case(  # the scheduler thinks the sampled token was appended / more was computed
        "computed-after-mid-prefill",
        lambda: [
            plan(1, new=[new(1, range(8), [0, 1], scheduled=3)]),
            plan(2, run=running([1], [1], [4])),
        ],
        "seq 1: plan says 4 computed tokens, mirror has 3",
    ),
    case(
        "new-negative-computed",
        lambda: [plan(1, new=[new(1, [1, 2, 3], [0], computed=-1, scheduled=2)])],
        "seq 1: num_computed_tokens=-1 with 3 token ids",
    ),
    # too few blocks
    case(
        "new-5-tokens-in-1-block",
        lambda: [plan(1, new=[new(1, range(5), [0])])],
        "seq 1: 1 blocks cannot hold 5 tokens",
    ),
    case(
        "new-9-tokens-in-2-blocks",
        lambda: [plan(1, new=[new(1, range(9), [0, 1])])],
        "seq 1: 2 blocks cannot hold 9 tokens",
    ),
    case(  # computed tokens count: the end is 4 + 5 = 9
        "new-9-tokens-4-computed-in-2-blocks",
        lambda: [plan(1, new=[new(1, range(9), [0, 1], computed=4)])],
        "seq 1: 2 blocks cannot hold 9 tokens",
    ),
    case(
        "new-no-blocks",
        lambda: [plan(1, new=[new(1, range(4), [], scheduled=1)])],
        "seq 1: 0 blocks cannot hold 1 tokens",
    ),
    case(  # prefill(8) fills its 2 blocks: decoding token 9 needs a third
        "decode-into-full-blocks",
        lambda: [prefill(8), plan(2, run=running([1], [1], [8]))],
        "seq 1: 2 blocks cannot hold 9 tokens",
    ),
    # block ids outside the pool
    *(
        case(
            f"new-block-id-{bad}",
            lambda bad=bad: [plan(1, new=[new(1, range(5), [0, bad])])],
            f"seq 1: block id outside [0, {NUM_BLOCKS})",
        )
        for bad in (NUM_BLOCKS, NUM_BLOCKS + 5, -1)
    ),
    *(
        case(
            f"delta-block-id-{bad}",
            lambda bad=bad: [prefill(8), plan(2, run=running([1], [1], [8], [1], [bad]))],
            f"seq 1: block id outside [0, {NUM_BLOCKS})",
        )
        for bad in (NUM_BLOCKS, -1)
    ),
    # running columns
    *(
        case(
            f"columns-{name}",
            lambda columns=columns: [prefill(6), plan(2, run=running(*columns))],
            "running columns differ in length",
        )
        for name, columns in [
            ("two-scheduled", ([1], [1, 1], [6], [0])),
            ("two-computed", ([1], [1], [6, 6], [0])),
            ("two-num-new-blocks", ([1], [1], [6], [0, 0])),
            ("no-scheduled", ([1], [], [6], [0])),
            ("no-seq-ids", ([], [1], [], [])),
        ]
    ),
    *(
        case(
            f"new-block-ids-{ids}-for-{count}",
            lambda count=count, ids=ids: [
                prefill(6),
                plan(2, run=running([1], [1], [6], [count], range(7, 7 + ids))),
            ],
            "new_block_ids longer than num_new_blocks says",
        )
        for count, ids in [(0, 1), (1, 2), (0, 3)]
    ),
    case(  # (the message says "longer" for a shorter list too)
        "new-block-ids-1-for-2",
        lambda: [prefill(6), plan(2, run=running([1], [1], [6], [2], [7]))],
        "new_block_ids longer than num_new_blocks says",
    ),
    # scheduled tokens
    *(
        case(
            f"running-{n}-scheduled-of-1-known",
            lambda n=n: [prefill(6), plan(2, run=running([1], [n], [6], [1], [9]))],
            f"seq 1: {n} tokens scheduled after 6 computed, but it has 7 tokens",
        )
        for n in (2, 3)
    ),
    *(
        case(
            f"running-{n}-scheduled",
            lambda n=n: [prefill(6), plan(2, run=running([1], [n], [6]))],
            f"seq 1: {n} tokens scheduled after 6 computed, but it has 7 tokens",
        )
        for n in (0, -1)
    ),
    case(
        "new-6-scheduled-of-5",
        lambda: [plan(1, new=[new(1, range(5), [0, 1], scheduled=6)])],
        "seq 1: 6 tokens scheduled after 0 computed, but it has 5 tokens",
    ),
    case(
        "new-3-scheduled-after-3-of-5",
        lambda: [plan(1, new=[new(1, range(5), [0, 1], computed=3, scheduled=3)])],
        "seq 1: 3 tokens scheduled after 3 computed, but it has 5 tokens",
    ),
    case(
        "new-all-5-computed",
        lambda: [plan(1, new=[new(1, range(5), [0, 1], computed=5, scheduled=1)])],
        "seq 1: num_computed_tokens=5 with 5 token ids",
    ),
    # prompt length
    *(
        case(
            f"new-prompt-{prompt}-of-{len(tokens)}",
            lambda prompt=prompt, tokens=tokens: [
                plan(1, new=[new(1, tokens, [0], scheduled=1, prompt=prompt)])
            ],
            f"seq 1: num_prompt_tokens={prompt} with {len(tokens)} token ids",
        )
        for prompt, tokens in [(0, [1, 2]), (3, [1, 2]), (-1, [1])]
    ),
]


@pytest.mark.parametrize(("plans", "fragment"), MISMATCHES)
def test_mismatch(plans: Plans, fragment: str) -> None:
    *before, bad = plans()
    m = applied(*before)
    with pytest.raises(MirrorMismatch, match=re.escape(fragment)):
        m.apply(bad)


# ---- EchoEngine ------------------------------------------------------------------------------


def test_fake_engine_echoes_prompt_cyclically() -> None:
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    prompt = [11, 12, 13]
    out = engine.step(plan(1, new=[new(1, prompt, [7])]))
    tokens = list(out.sampled_token_ids)
    computed = 3
    table = [7]
    for step in range(2, 10):
        new_blocks = [20 + step] if computed + 1 > len(table) * 4 else []
        table += new_blocks
        out = engine.step(
            plan(step, run=running([1], [1], [computed], [len(new_blocks)], new_blocks))
        )
        tokens += out.sampled_token_ids
        computed += 1
    assert tokens == [11, 12, 13, 11, 12, 13, 11, 12, 13]
    assert engine.mirror.seqs[1].token_ids == prompt + tokens
    assert engine.num_steps == 9


def test_fake_engine_step_time_grows_with_its_tokens() -> None:
    """step_delay_ms + step_token_delay_ms per token computed: 10 + 0.5 x (5 + 3) = 14 ms."""
    fake = EchoEngineConfig(step_delay_ms=10.0, step_token_delay_ms=0.5)
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=32), fake)
    start = time.monotonic()
    step = engine.launch(plan(1, new=[new(1, [5, 6, 7, 8, 9], [0, 1]), new(2, [3, 4, 5], [2])]))
    assert step.output.forward_ms == 14.0
    assert 0.014 <= step.ready_at - start < 0.1
    engine.finish(step)


def test_fake_engine_mid_prefill_and_batch() -> None:
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    out = engine.step(plan(1, new=[new(1, [5, 6, 7, 8, 9], [0, 1], scheduled=2), new(2, [3], [2])]))
    assert out.sampled_token_ids == [-1, 3]
    assert out.logprobs is None
    out = engine.step(plan(2, run=running([1, 2], [3, 1], [2, 1])))
    assert out.sampled_token_ids == [5, 3]
    out = engine.step(plan(3, run=running([2, 1], [1, 1], [2, 5])))
    assert out.sampled_token_ids == [3, 6]


def test_fake_engine_resumes_after_preemption() -> None:
    """Token i is prompt[i % len(prompt)] even when generated tokens come back in token_ids."""
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    out = engine.step(plan(1, new=[new(1, [1, 2, 3, 9, 9], [0, 1], prompt=3)]))
    assert out.sampled_token_ids == [3]


def test_fake_engine_logprobs_and_mismatch() -> None:
    engine = EchoEngine(EngineConfig(block_size=4, num_kv_blocks=8))
    req = new(1, [4, 4, 4], [0], scheduled=2, logprobs=True)
    out = engine.step(plan(1, new=[req, new(2, [1], [1])]))
    assert out.sampled_token_ids == [-1, 1]
    assert out.logprobs is None  # the row that asked sampled nothing yet
    out = engine.step(plan(2, run=running([1, 2], [1, 1], [2, 1])))
    assert out.sampled_token_ids == [4, 1]
    assert out.logprobs is not None and out.logprobs[0] == 0.0
    assert math.isnan(out.logprobs[1])  # row 2 did not ask
    with pytest.raises(MirrorMismatch, match="seq 1: plan says 1 computed tokens, mirror has 3"):
        engine.step(plan(3, run=running([1], [1], [1])))
    engine.reset()
    assert engine.mirror.seqs == {}
