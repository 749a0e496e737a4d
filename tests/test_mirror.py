"""engine.mirror.Mirror: the one-token rule and every way a plan can disagree with the mirror;
engine.fake.FakeEngine's echo."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.contract import NewRequestData, RunningData, StepPlanData
from engine.fake import FakeEngine
from engine.mirror import PLACEHOLDER, Mirror, MirrorMismatch
from tests.factories import sampling

BLOCK_SIZE = 4
NUM_BLOCKS = 16


def new_req(
    seq_id: int,
    token_ids: list[int],
    block_table: list[int],
    num_scheduled: int,
    num_computed: int = 0,
    num_prompt: int | None = None,
) -> NewRequestData:
    return NewRequestData(
        seq_id=seq_id,
        token_ids=list(token_ids),
        num_prompt_tokens=len(token_ids) if num_prompt is None else num_prompt,
        sampling=sampling(temperature=0.0),
        block_table=list(block_table),
        num_computed_tokens=num_computed,
        num_scheduled_tokens=num_scheduled,
    )


def running(
    seq_ids: list[int] | None = None,
    num_scheduled: list[int] | None = None,
    num_computed: list[int] | None = None,
    num_new_blocks: list[int] | None = None,
    new_block_ids: list[int] | None = None,
) -> RunningData:
    seq_ids = seq_ids or []
    return RunningData(
        seq_ids=seq_ids,
        num_scheduled_tokens=num_scheduled if num_scheduled is not None else [],
        num_computed_tokens=num_computed if num_computed is not None else [],
        num_new_blocks=num_new_blocks if num_new_blocks is not None else [0] * len(seq_ids),
        new_block_ids=new_block_ids or [],
    )


def plan(
    step_id: int,
    new: list[NewRequestData] | None = None,
    run: RunningData | None = None,
    finished: list[int] | None = None,
) -> StepPlanData:
    return StepPlanData(step_id, finished or [], new or [], run or running())


def mirror_with_seq(seq_id: int = 1, num_tokens: int = 6) -> Mirror:
    """A mirror holding one request whose prompt of num_tokens is fully computed and which has
    appended sampled token 100 (so it has num_tokens + 1 tokens, num_tokens computed)."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    blocks = list(range(3, 3 + -(-num_tokens // BLOCK_SIZE)))
    batch = m.apply(plan(1, new=[new_req(seq_id, list(range(num_tokens)), blocks, num_tokens)]))
    m.commit(batch, [100])
    return m


# ---- the one-token rule ----------------------------------------------------------------------


def test_new_request_row_covers_scheduled_tokens() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new_req(7, [10, 11, 12, 13, 14], [5, 2], 3, num_computed=1)]))
    assert batch.step_id == 1
    (row,) = batch.rows
    assert (row.seq.seq_id, row.start, row.end, row.num_scheduled_tokens) == (7, 1, 4, 3)
    assert not row.samples
    assert batch.num_tokens == 3
    assert m.seqs[7].block_table == [5, 2]


def test_commit_mid_prefill_discards_token_then_completion_appends() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    prompt = [10, 11, 12, 13, 14, 15, 16]
    batch = m.apply(plan(1, new=[new_req(1, prompt, [0, 1], 4)]))
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
    step1 = m.apply(plan(1, new=[new_req(1, prompt, [0, 1], 7), new_req(2, [5, 6], [2], 1)]))
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
    step1 = m.apply(plan(1, new=[new_req(1, [1, 2, 3], [0], 3)]))
    m.commit_pending(step1)
    m.apply(plan(2, finished=[1], new=[new_req(1, [1, 2, 3], [4], 3)]))
    m.resolve(step1, [9])
    assert m.seqs[1].token_ids == [1, 2, 3]


def test_commit_rows_in_plan_order_new_first() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(2, new=[new_req(2, [1, 2, 3], [0], 3)], run=running([1], [1], [6])))
    assert [r.seq.seq_id for r in batch.rows] == [2, 1]
    m.commit(batch, [50, 51])
    assert m.seqs[2].token_ids == [1, 2, 3, 50]
    assert m.seqs[1].token_ids == [0, 1, 2, 3, 4, 5, 100, 51]


def test_commit_requires_one_token_per_row() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new_req(1, [1, 2], [0], 2)]))
    with pytest.raises(ValueError):
        m.commit(batch, [])


def test_new_request_with_generated_tokens_resumes_output_count() -> None:
    """A preempted request comes back with its generated tokens in token_ids."""
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new_req(1, [1, 2, 3, 7, 8], [0, 1], 5, num_prompt=3)]))
    assert m.seqs[1].num_output_tokens == 2
    m.commit(batch, [9])
    assert m.seqs[1].token_ids == [1, 2, 3, 7, 8, 9]
    assert m.seqs[1].num_output_tokens == 3


def test_finished_dropped_before_new_so_an_id_can_come_back() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(2, new=[new_req(1, [5, 5], [4], 2)], finished=[1]))
    assert m.seqs[1].token_ids == [5, 5]
    assert batch.rows[0].seq is m.seqs[1]


def test_empty_plan_gives_empty_batch() -> None:
    m = mirror_with_seq(1, 6)
    batch = m.apply(plan(5, finished=[1]))
    assert batch.rows == []
    assert m.seqs == {}
    assert m.last_step_id == 5


# ---- mismatches ------------------------------------------------------------------------------


@pytest.mark.parametrize("step_id", [1, 0, -3])
def test_step_id_must_increase(step_id: int) -> None:
    m = mirror_with_seq()  # applied step 1
    with pytest.raises(MirrorMismatch, match="step_id"):
        m.apply(plan(step_id))


def test_unknown_running_id() -> None:
    m = mirror_with_seq(1)
    with pytest.raises(MirrorMismatch, match="running seq 2"):
        m.apply(plan(2, run=running([2], [1], [6])))


@pytest.mark.parametrize("claimed", [5, 7, 0])
def test_computed_token_mismatch(claimed: int) -> None:
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch, match="computed tokens"):
        m.apply(plan(2, run=running([1], [1], [claimed])))


def test_computed_tokens_checked_after_mid_prefill() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    m.commit(m.apply(plan(1, new=[new_req(1, list(range(8)), [0, 1], 3)])), [5])
    with pytest.raises(MirrorMismatch, match="computed tokens"):
        # the scheduler thinks the sampled token was appended / more was computed
        m.apply(plan(2, run=running([1], [1], [4])))


def test_unknown_finished_id() -> None:
    m = mirror_with_seq(1)
    with pytest.raises(MirrorMismatch, match="finished seq 3"):
        m.apply(plan(2, finished=[3]))


def test_finished_twice() -> None:
    m = mirror_with_seq(1)
    with pytest.raises(MirrorMismatch, match="finished seq 1"):
        m.apply(plan(2, finished=[1, 1]))


def test_duplicate_new_id_already_running() -> None:
    m = mirror_with_seq(1)
    with pytest.raises(MirrorMismatch, match="already in the mirror"):
        m.apply(plan(2, new=[new_req(1, [1, 2], [0], 2)]))


def test_duplicate_new_id_in_one_plan() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(MirrorMismatch, match="listed twice"):
        m.apply(plan(1, new=[new_req(4, [1, 2], [0], 2), new_req(4, [3], [1], 1)]))


def test_duplicate_running_id_in_one_plan() -> None:
    """The same request scheduled twice in one step would be computed (and committed) twice."""
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch):
        m.apply(plan(2, run=running([1, 1], [1, 1], [6, 6])))


def test_new_id_also_listed_as_running() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(MirrorMismatch):
        m.apply(plan(1, new=[new_req(1, [1, 2, 3], [0], 2)], run=running([1], [1], [0])))


@pytest.mark.parametrize(
    ("num_tokens", "blocks", "num_computed", "num_scheduled"),
    [
        (5, [0], 0, 5),  # 1 block of 4 cannot hold 5 tokens
        (9, [0, 1], 0, 9),
        (9, [0, 1], 4, 5),  # computed tokens count: end = 9
        (4, [], 0, 1),
    ],
)
def test_too_few_blocks_for_new_request(
    num_tokens: int, blocks: list[int], num_computed: int, num_scheduled: int
) -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    req = new_req(1, list(range(num_tokens)), blocks, num_scheduled, num_computed)
    with pytest.raises(MirrorMismatch, match="blocks cannot hold"):
        m.apply(plan(1, new=[req]))


def test_exactly_enough_blocks_is_fine() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    batch = m.apply(plan(1, new=[new_req(1, list(range(8)), [3, 2], 8)]))
    assert batch.rows[0].end == 8


def test_too_few_blocks_for_decode() -> None:
    m = mirror_with_seq(1, 8)  # 2 full blocks, 9 tokens, 8 computed
    with pytest.raises(MirrorMismatch, match="blocks cannot hold 9"):
        m.apply(plan(2, run=running([1], [1], [8])))


@pytest.mark.parametrize("bad", [NUM_BLOCKS, NUM_BLOCKS + 5, -1])
def test_block_id_out_of_range_in_new_request(bad: int) -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(MirrorMismatch, match="block id outside"):
        m.apply(plan(1, new=[new_req(1, [1, 2, 3, 4, 5], [0, bad], 5)]))


@pytest.mark.parametrize("bad", [NUM_BLOCKS, -1])
def test_block_id_out_of_range_in_delta(bad: int) -> None:
    m = mirror_with_seq(1, 8)
    with pytest.raises(MirrorMismatch, match="block id outside"):
        m.apply(plan(2, run=running([1], [1], [8], [1], [bad])))


def test_last_valid_block_id_accepted() -> None:
    m = mirror_with_seq(1, 8)
    m.apply(plan(2, run=running([1], [1], [8], [1], [NUM_BLOCKS - 1])))
    assert m.seqs[1].block_table[-1] == NUM_BLOCKS - 1


@pytest.mark.parametrize(
    "run",
    [
        RunningData([1], [1, 1], [6], [0], []),
        RunningData([1], [1], [6, 6], [0], []),
        RunningData([1], [1], [6], [0, 0], []),
        RunningData([1], [], [6], [0], []),
        RunningData([], [1], [], [], []),
    ],
)
def test_running_columns_of_different_lengths(run: RunningData) -> None:
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch, match="differ in length"):
        m.apply(plan(2, run=run))


@pytest.mark.parametrize(
    ("num_new_blocks", "new_block_ids"),
    [([0], [7]), ([1], [7, 8]), ([0], [7, 8, 9])],
)
def test_extra_new_block_ids(num_new_blocks: list[int], new_block_ids: list[int]) -> None:
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch, match="new_block_ids"):
        m.apply(plan(2, run=running([1], [1], [6], num_new_blocks, new_block_ids)))


def test_too_few_new_block_ids() -> None:
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch):
        m.apply(plan(2, run=running([1], [1], [6], [2], [7])))


def test_new_block_ids_split_by_count() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    b = m.apply(
        plan(1, new=[new_req(1, list(range(4)), [0], 4), new_req(2, list(range(8)), [1, 2], 8)])
    )
    m.commit(b, [4, 8])
    m.apply(plan(2, run=running([2, 1], [1, 1], [8, 4], [1, 2], [9, 5, 6])))
    assert m.seqs[2].block_table == [1, 2, 9]
    assert m.seqs[1].block_table == [0, 5, 6]


@pytest.mark.parametrize("num_scheduled", [2, 3])
def test_scheduling_beyond_known_tokens_running(num_scheduled: int) -> None:
    m = mirror_with_seq(1, 6)  # 7 tokens, 6 computed
    with pytest.raises(MirrorMismatch, match="tokens scheduled"):
        m.apply(plan(2, run=running([1], [num_scheduled], [6], [1], [9])))


@pytest.mark.parametrize(
    ("num_computed", "num_scheduled", "error"),
    [(0, 6, "tokens scheduled"), (3, 3, "tokens scheduled"), (5, 1, "num_computed_tokens=5")],
)
def test_scheduling_beyond_known_tokens_new(
    num_computed: int, num_scheduled: int, error: str
) -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    req = new_req(1, [1, 2, 3, 4, 5], [0, 1], num_scheduled, num_computed)
    with pytest.raises(MirrorMismatch, match=error):
        m.apply(plan(1, new=[req]))


@pytest.mark.parametrize("num_scheduled", [0, -1])
def test_nothing_scheduled(num_scheduled: int) -> None:
    m = mirror_with_seq(1, 6)
    with pytest.raises(MirrorMismatch, match="tokens scheduled"):
        m.apply(plan(2, run=running([1], [num_scheduled], [6])))


def test_negative_computed_tokens_in_new_request() -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(MirrorMismatch):
        m.apply(plan(1, new=[new_req(1, [1, 2, 3], [0], 2, num_computed=-1)]))


@pytest.mark.parametrize(("num_prompt", "tokens"), [(0, [1, 2]), (3, [1, 2]), (-1, [1])])
def test_bad_num_prompt_tokens(num_prompt: int, tokens: list[int]) -> None:
    m = Mirror(BLOCK_SIZE, NUM_BLOCKS)
    with pytest.raises(MirrorMismatch, match="num_prompt_tokens"):
        m.apply(plan(1, new=[new_req(1, tokens, [0], 1, num_prompt=num_prompt)]))


# ---- FakeEngine ------------------------------------------------------------------------------


def test_fake_engine_echoes_prompt_cyclically() -> None:
    engine = FakeEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    prompt = [11, 12, 13]
    out = engine.step(plan(1, new=[new_req(1, prompt, [7], 3)]))
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


def test_fake_engine_mid_prefill_and_batch() -> None:
    engine = FakeEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    out = engine.step(
        plan(1, new=[new_req(1, [5, 6, 7, 8, 9], [0, 1], 2), new_req(2, [3], [2], 1)])
    )
    assert out.sampled_token_ids == [-1, 3]
    assert out.logprobs is None
    out = engine.step(plan(2, run=running([1, 2], [3, 1], [2, 1])))
    assert out.sampled_token_ids == [5, 3]
    out = engine.step(plan(3, run=running([2, 1], [1, 1], [2, 5], [0, 0])))
    assert out.sampled_token_ids == [3, 6]


def test_fake_engine_resumes_after_preemption() -> None:
    """Token i is prompt[i % len(prompt)] even when generated tokens come back in token_ids."""
    engine = FakeEngine(EngineConfig(block_size=4, num_kv_blocks=32))
    out = engine.step(plan(1, new=[new_req(1, [1, 2, 3, 9, 9], [0, 1], 5, num_prompt=3)]))
    assert out.sampled_token_ids == [3]


def test_fake_engine_logprobs_and_mismatch() -> None:
    engine = FakeEngine(EngineConfig(block_size=4, num_kv_blocks=8))
    req = new_req(1, [4, 4, 4], [0], 2)
    req.sampling = sampling(logprobs=True)
    out = engine.step(plan(1, new=[req, new_req(2, [1], [1], 1)]))
    assert out.sampled_token_ids == [-1, 1]
    assert out.logprobs is None  # the row that asked sampled nothing yet
    out = engine.step(plan(2, run=running([1, 2], [1, 1], [2, 1])))
    assert out.sampled_token_ids == [4, 1]
    assert out.logprobs is not None and out.logprobs[0] == 0.0
    assert out.logprobs[1] != out.logprobs[1]  # NaN: row 2 did not ask
    with pytest.raises(MirrorMismatch):
        engine.step(plan(3, run=running([1], [1], [1])))
    engine.reset()
    assert engine.mirror.seqs == {}
