"""BlockManager with concrete block ids: allocation order, free-queue (eviction) order, the prefix
cache and the integrity check. block_size is 4 throughout, so token t lives in block t // 4."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import llmserve.common.block_hash as block_hash_module
from llmserve.scheduler.block_manager import BlockManager
from llmserve.scheduler.request import Request, SamplingParams

BS = 4


def make_request(seq_id: int, token_ids: list[int]) -> Request:
    return Request(f"req-{seq_id}", seq_id, list(token_ids), SamplingParams(), max_tokens=16)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def compute(bm: BlockManager, request: Request, num_new: int, cached: list[int] | None = None):
    """Allocate like the scheduler does, then advance num_computed_tokens."""
    assert bm.allocate_slots(request, num_new, cached)
    request.num_computed_tokens += len(cached or []) * BS + num_new


class Tracker:
    """The requests a test makes; each scenario ends with check_integrity over the holders."""

    def __init__(self) -> None:
        self.bm: BlockManager | None = None
        self.requests: list[Request] = []

    def new(self, num_blocks: int, enable_prefix_caching: bool = True) -> BlockManager:
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching)
        return self.bm

    def request(self, seq_id: int, token_ids: list[int]) -> Request:
        r = make_request(seq_id, token_ids)
        self.requests.append(r)
        return r


@pytest.fixture
def t() -> Iterator[Tracker]:
    tracker = Tracker()
    yield tracker
    assert tracker.bm is not None
    tracker.bm.check_integrity([r for r in tracker.requests if r.block_table])


def chained_hashes(token_ids: list[int]) -> list[int]:
    out: list[int] = []
    for i in range(len(token_ids) // BS):
        parent = out[-1] if out else 0
        out.append(hash((parent, tuple(token_ids[i * BS : (i + 1) * BS]))))
    return out


# -- allocation and freeing ---------------------------------------------------------------------


def test_allocation_takes_blocks_from_the_front_of_the_free_queue(t: Tracker) -> None:
    bm = t.new(8)
    a = t.request(1, tokens(0, 6))
    b = t.request(2, tokens(100, 3))
    compute(bm, a, 6)
    assert a.block_table == [0, 1]
    compute(bm, b, 3)
    assert b.block_table == [2]
    assert list(bm.free_blocks) == [3, 4, 5, 6, 7]
    assert bm.ref_cnt == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (bm.num_free_blocks, bm.num_blocks - bm.num_free_blocks) == (5, 3)


def test_block_table_grows_as_tokens_are_added(t: Tracker) -> None:
    bm = t.new(8)
    a = t.request(1, tokens(0, 3))
    b = t.request(2, tokens(100, 2))
    compute(bm, a, 3)
    compute(bm, b, 2)
    assert (a.block_table, b.block_table) == ([0], [1])
    # a decodes: tokens 3 still fits block 0, token 4 needs a new block.
    a.token_ids.append(50)
    compute(bm, a, 1)
    assert a.block_table == [0]
    a.token_ids.append(51)
    compute(bm, a, 1)
    assert a.block_table == [0, 2]
    # a chunk of 7 more tokens (5..11) spans blocks 1 and 2 of a: one new block, id 3.
    a.token_ids.extend(tokens(60, 7))
    compute(bm, a, 7)
    assert a.block_table == [0, 2, 3]
    assert a.num_computed_tokens == 12
    # one token more: a fourth block.
    a.token_ids.append(70)
    compute(bm, a, 1)
    assert a.block_table == [0, 2, 3, 4]
    assert list(bm.free_blocks) == [5, 6, 7]


def test_free_returns_last_block_first_to_the_back_of_the_queue(t: Tracker) -> None:
    bm = t.new(8, enable_prefix_caching=False)
    a = t.request(1, tokens(0, 12))
    b = t.request(2, tokens(100, 8))
    compute(bm, a, 12)
    compute(bm, b, 8)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    bm.free(a)
    assert a.block_table == []
    assert list(bm.free_blocks) == [5, 6, 7, 2, 1, 0]
    bm.free(b)
    assert list(bm.free_blocks) == [5, 6, 7, 2, 1, 0, 4, 3]
    assert bm.ref_cnt == [0] * 8
    # The next allocations reuse blocks in exactly that order.
    c = t.request(3, tokens(200, 20))
    compute(bm, c, 20)
    assert c.block_table == [5, 6, 7, 2, 1]
    d = t.request(4, tokens(300, 9))
    compute(bm, d, 9)
    assert d.block_table == [0, 4, 3]
    assert bm.num_free_blocks == 0


def test_shared_block_is_freed_only_by_its_last_holder(t: Tracker) -> None:
    bm = t.new(8)
    prompt = tokens(0, 9)
    a = t.request(1, prompt)
    compute(bm, a, 9)
    b = t.request(2, prompt)
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]
    compute(bm, b, 1, cached)
    assert b.block_table == [0, 1, 3]
    assert bm.ref_cnt[:4] == [2, 2, 1, 1]
    # Blocks held by the other request too count for neither, nor for both together.
    assert [bm.num_owned_blocks(r) for r in ([a], [b], [a, b])] == [1, 1, 2]
    bm.free(a)
    assert list(bm.free_blocks) == [4, 5, 6, 7, 2]
    assert bm.ref_cnt[:4] == [1, 1, 0, 1]
    assert bm.num_owned_blocks([b]) == 3
    bm.check_integrity([b])
    bm.free(b)
    assert list(bm.free_blocks) == [4, 5, 6, 7, 2, 3, 1, 0]


def test_allocate_slots_short_of_blocks_returns_false_and_changes_nothing(t: Tracker) -> None:
    bm = t.new(4)
    a = t.request(1, tokens(0, 9))
    compute(bm, a, 9)  # blocks 0, 1, 2; 1 free
    b = t.request(2, tokens(100, 5))

    def snapshot() -> tuple:
        return (
            list(bm.free_blocks),
            list(bm.ref_cnt),
            dict(bm.hash_to_block),
            dict(bm.block_key),
            list(b.block_table),
            list(b.block_hashes),
            b.num_computed_tokens,
            list(a.block_table),
        )

    before = snapshot()
    assert not bm.allocate_slots(b, 5)  # needs 2 blocks, 1 free
    assert snapshot() == before
    # a growing past its blocks: 17 tokens need 2 more blocks, 1 free.
    a.token_ids.extend(tokens(20, 8))
    before = snapshot()
    assert not bm.allocate_slots(a, 8)
    assert snapshot() == before
    # exactly enough: succeeds.
    assert bm.allocate_slots(b, 4)
    assert b.block_table == [3]
    assert bm.num_free_blocks == 0


def test_reviving_cached_free_blocks_counts_against_free_blocks(t: Tracker) -> None:
    bm = t.new(5)
    prompt = tokens(0, 12)
    a = t.request(1, prompt)
    compute(bm, a, 12)  # blocks 0, 1, 2, all full and cached
    bm.free(a)
    assert list(bm.free_blocks) == [3, 4, 2, 1, 0]
    filler = t.request(2, tokens(500, 8))
    compute(bm, filler, 8)  # takes 3 and 4
    assert filler.block_table == [3, 4]
    b = t.request(3, [*prompt, 77])
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1, 2]
    # 3 free blocks, all of them the cached ones: reviving them plus 1 new block needs 4.
    before = (list(bm.free_blocks), list(bm.ref_cnt), list(b.block_table))
    assert not bm.allocate_slots(b, 1, cached)
    assert (list(bm.free_blocks), list(bm.ref_cnt), list(b.block_table)) == before
    # With the filler gone there are 5 free blocks: revive 0, 1, 2 and take 4.
    bm.free(filler)
    assert list(bm.free_blocks) == [2, 1, 0, 4, 3]
    assert bm.allocate_slots(b, 1, cached)
    assert b.block_table == [0, 1, 2, 4]
    assert list(bm.free_blocks) == [3]
    assert bm.ref_cnt == [1, 1, 1, 0, 1]


# -- prefix cache -------------------------------------------------------------------------------


def test_full_blocks_get_chained_hashes(t: Tracker) -> None:
    bm = t.new(8)
    prompt = tokens(0, 10)
    a = t.request(1, prompt)
    compute(bm, a, 10)
    expected = chained_hashes(prompt)
    assert len(expected) == 2
    assert a.block_hashes == expected
    assert bm.hash_to_block == {expected[0]: 0, expected[1]: 1}
    assert bm.block_key == {
        0: (expected[0], 0, (0, 1, 2, 3)),
        1: (expected[1], expected[0], (4, 5, 6, 7)),
    }
    # Block 2 (tokens 8, 9) is partial: not cached until it fills.
    a.token_ids.extend([10, 11])
    compute(bm, a, 2)
    expected = chained_hashes(a.token_ids)
    assert a.block_hashes == expected
    assert bm.hash_to_block[expected[2]] == 2
    assert bm.block_key[2] == (expected[2], expected[1], (8, 9, 10, 11))


def test_same_tokens_at_another_position_do_not_hit(t: Tracker) -> None:
    """The hash is chained: block content alone does not make a hit."""
    bm = t.new(8)
    a = t.request(1, tokens(0, 9))
    compute(bm, a, 9)
    # b starts with a's second block (4..7): same tokens, but its parent is 0, not hash(0..3).
    b = t.request(2, [*tokens(4, 4), *tokens(0, 5)])
    assert bm.find_cached_blocks(b) == []
    # Diverging in the first block stops the chain even if later blocks match.
    c = t.request(3, [0, 1, 2, 99, *tokens(4, 5)])
    assert bm.find_cached_blocks(c) == []


def test_find_cached_blocks_hits_only_full_blocks_and_leaves_a_token_to_compute(
    t: Tracker,
) -> None:
    bm = t.new(8)
    prompt = tokens(0, 8)
    a = t.request(1, prompt)
    compute(bm, a, 8)
    bm.free(a)
    # Exactly the 8 cached tokens: only 1 block may hit, the last token must be computed.
    same = t.request(2, prompt)
    assert bm.find_cached_blocks(same) == [0]
    # One token more: both blocks hit.
    longer = t.request(3, [*prompt, 8])
    assert bm.find_cached_blocks(longer) == [0, 1]
    # A prompt shorter than a block never hits.
    short = t.request(4, tokens(0, 4))
    assert bm.find_cached_blocks(short) == []
    # find changes nothing.
    assert list(bm.free_blocks) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.ref_cnt == [0] * 8


def test_partial_block_is_not_cached(t: Tracker) -> None:
    bm = t.new(8)
    a = t.request(1, tokens(0, 6))
    compute(bm, a, 6)
    assert list(bm.hash_to_block.values()) == [0]
    assert set(bm.block_key) == {0}
    b = t.request(2, [*tokens(0, 6), 40, 41, 42])
    assert bm.find_cached_blocks(b) == [0]


def test_hash_collision_is_rejected_by_comparing_tokens(
    t: Tracker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every block hashes to 42: any lookup finds a block, only the stored key can tell.
    monkeypatch.setattr(block_hash_module, "hash", lambda _: 42, raising=False)
    bm = t.new(8)
    a = t.request(1, tokens(0, 9))
    compute(bm, a, 9)
    # Block 1's hash is already mapped (to block 0), so only block 0 is cached.
    assert bm.hash_to_block == {42: 0}
    assert bm.block_key == {0: (42, 0, (0, 1, 2, 3))}
    other = t.request(2, tokens(100, 9))
    assert other.block_hashes == []
    assert bm.find_cached_blocks(other) == []
    assert other.block_hashes == [42, 42]
    # The true prefix hits block 0; its second block collides with block 0 but differs.
    same = t.request(3, tokens(0, 9))
    assert bm.find_cached_blocks(same) == [0]


def test_forced_block_key_mismatch_is_a_miss(t: Tracker) -> None:
    bm = t.new(8)
    prompt = tokens(0, 9)
    a = t.request(1, prompt)
    compute(bm, a, 9)
    bm.free(a)
    block_hash, parent, _ = bm.block_key[1]
    bm.block_key[1] = (block_hash, parent, (4, 5, 6, 99))  # same hash, other tokens
    b = t.request(2, prompt)
    assert bm.find_cached_blocks(b) == [0]
    bm.block_key[0] = (bm.block_key[0][0], 12345, bm.block_key[0][2])  # wrong parent
    assert bm.find_cached_blocks(b) == []


def test_eviction_is_tail_first_and_removes_the_hash(t: Tracker) -> None:
    bm = t.new(6)
    prompt = tokens(0, 12)
    a = t.request(1, prompt)
    compute(bm, a, 12)
    hashes = chained_hashes(prompt)
    bm.free(a)
    assert list(bm.free_blocks) == [3, 4, 5, 2, 1, 0]
    # 4 new blocks: 3, 4, 5 (never used) then 2, the tail of a's prefix.
    b = t.request(2, tokens(100, 14))
    compute(bm, b, 14)
    assert b.block_table == [3, 4, 5, 2]
    assert hashes[2] not in bm.hash_to_block
    assert bm.hash_to_block[hashes[0]] == 0
    assert bm.hash_to_block[hashes[1]] == 1
    # Block 2 now holds b's (partial) tokens 12..13: no key at all.
    assert 2 not in bm.block_key
    c = t.request(3, [*prompt, 1])
    assert bm.find_cached_blocks(c) == [0, 1]
    # One more block: 1 goes next (least recently freed after 2), then 0.
    d = t.request(4, tokens(200, 3))
    compute(bm, d, 3)
    assert d.block_table == [1]
    assert hashes[1] not in bm.hash_to_block
    assert 1 not in bm.block_key
    assert bm.find_cached_blocks(c) == [0]
    assert bm.hash_to_block == {
        hashes[0]: 0,
        **{h: blk for h, blk in zip(chained_hashes(b.token_ids), [3, 4, 5], strict=True)},
    }


def test_same_content_cached_once(t: Tracker) -> None:
    """Two requests computing the same block without a lookup: the first block stays cached."""
    bm = t.new(8)
    a = t.request(1, tokens(0, 5))
    b = t.request(2, tokens(0, 5))
    compute(bm, a, 5)
    compute(bm, b, 5)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert bm.hash_to_block == {chained_hashes(tokens(0, 4))[0]: 0}
    assert set(bm.block_key) == {0}
    # When block 0 is evicted, b's copy gets registered on its next allocation.
    bm.free(a)
    assert list(bm.free_blocks) == [4, 5, 6, 7, 1, 0]
    filler = t.request(3, tokens(100, 24))
    compute(bm, filler, 24)
    assert filler.block_table == [4, 5, 6, 7, 1, 0]
    assert chained_hashes(tokens(0, 4))[0] not in bm.hash_to_block
    b.token_ids.append(9)
    compute(bm, b, 1)
    assert bm.hash_to_block[chained_hashes(tokens(0, 4))[0]] == 2


def test_prefix_caching_disabled(t: Tracker) -> None:
    bm = t.new(8, enable_prefix_caching=False)
    a = t.request(1, tokens(0, 9))
    compute(bm, a, 9)
    assert bm.hash_to_block == {} and bm.block_key == {}
    bm.free(a)
    b = t.request(2, tokens(0, 9))
    assert bm.find_cached_blocks(b) == []


def test_reset_prefix_cache(t: Tracker) -> None:
    bm = t.new(8)
    a = t.request(1, tokens(0, 9))
    b = t.request(2, tokens(100, 8))
    compute(bm, a, 9)
    compute(bm, b, 8)
    bm.free(b)
    free_before = list(bm.free_blocks)
    assert len(bm.hash_to_block) == 4
    bm.reset_prefix_cache()
    assert bm.hash_to_block == {} and bm.block_key == {}
    assert list(bm.free_blocks) == free_before
    assert bm.ref_cnt[:3] == [1, 1, 1]
    assert bm.find_cached_blocks(t.request(3, tokens(0, 9))) == []
    assert bm.find_cached_blocks(t.request(4, tokens(100, 9))) == []


# -- integrity check ----------------------------------------------------------------------------


def _two_requests() -> tuple[BlockManager, Request, Request]:
    bm = BlockManager(8, BS)
    a = make_request(1, tokens(0, 9))
    b = make_request(2, tokens(100, 5))
    compute(bm, a, 9)
    compute(bm, b, 5)
    bm.check_integrity([a, b])
    return bm, a, b


def test_check_integrity_catches_extra_ref_count() -> None:
    bm, a, b = _two_requests()
    bm.ref_cnt[0] += 1
    bm.check_integrity()  # still consistent on its own
    with pytest.raises(AssertionError, match="ref counts disagree"):
        bm.check_integrity([a, b])


def test_check_integrity_catches_used_block_in_free_queue() -> None:
    bm, a, b = _two_requests()
    bm.free_blocks[0] = None
    with pytest.raises(AssertionError, match="free \\+ used != total"):
        bm.check_integrity([a, b])


def test_check_integrity_catches_free_block_with_ref_count() -> None:
    bm, _, _ = _two_requests()
    # Totals still add up (block 0 free but held, block 7 neither): the per-block check fires.
    bm.free_blocks[0] = None
    del bm.free_blocks[7]
    with pytest.raises(AssertionError, match="block 0: ref count 1 but free=True"):
        bm.check_integrity()


def test_check_integrity_catches_negative_ref_count() -> None:
    bm, _, _ = _two_requests()
    # Totals still add up (block 7 free and held): the ref count check fires first.
    bm.ref_cnt[0] = -1
    bm.ref_cnt[7] = 1
    with pytest.raises(AssertionError, match="block 0 has ref count -1"):
        bm.check_integrity()


def test_check_integrity_catches_wrong_hash_map() -> None:
    bm, a, b = _two_requests()
    bm.hash_to_block[a.block_hashes[0]] = 1
    with pytest.raises(AssertionError, match="hash map wrong for 1"):
        bm.check_integrity([a, b])


def test_check_integrity_catches_missing_block_table_entry() -> None:
    bm, a, b = _two_requests()
    a.block_table.pop()
    with pytest.raises(AssertionError, match="ref counts disagree"):
        bm.check_integrity([a, b])


def test_double_free_is_caught() -> None:
    bm, a, _ = _two_requests()
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(a)


def test_block_hashes_are_the_rule_the_gateway_routes_by(t: Tracker) -> None:
    """The scheduler's cached-block hashes are exactly common.block_hash's chain of the prompt's
    full blocks, which the gateway's prefix routing computes from token ids alone."""
    from llmserve.common.block_hash import block_hashes, hash_block

    bm = t.new(8)
    a = t.request(1, tokens(0, 10))
    compute(bm, a, 10)
    assert a.block_hashes == block_hashes(tokens(0, 10), 4)
    h0 = hash_block(0, [0, 1, 2, 3])
    assert a.block_hashes == [h0, hash_block(h0, [4, 5, 6, 7])]
    assert block_hashes(tokens(0, 10), 4, max_blocks=1) == [h0]
