"""Block pools and the block manager alone: allocation, reference counts, copy-on-write,
prefix caching with LRU eviction, and swapping with shared blocks."""

from __future__ import annotations

import pytest

from attnexport.runtime.block_manager import BlockManager, BlockPool
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.sequence import Request, SequenceState


def _seq(tokens, seq_id=0, request=None) -> SequenceState:
    request = request or Request(f"r{seq_id}", list(tokens), SamplingParams(), seq_id)
    seq = SequenceState(seq_id, request, list(tokens), 0, None)
    request.seqs.append(seq)
    return seq


def _grow(bm: BlockManager, seq: SequenceState, count: int) -> None:
    bm.allocate(seq, count)
    seq.num_computed += count
    bm.register_full_blocks(seq)


def test_pool_allocates_every_block_once_and_reuses_freed_ones():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and pool.num_free == 0
    with pytest.raises(RuntimeError, match="no free block"):
        pool.allocate()
    pool.incref(blocks[1])
    pool.decref(blocks[1])
    assert pool.num_free == 0  # still referenced once
    pool.decref(blocks[1])
    assert pool.num_free == 1 and pool.allocate() == blocks[1]
    pool.decref(blocks[0])
    with pytest.raises(RuntimeError, match="already free"):
        pool.decref(blocks[0])


def test_sequence_grows_block_by_block_and_frees_everything():
    bm = BlockManager(8, 0, block_size=4, enable_prefix_caching=False)
    seq = _seq(range(10))
    assert bm.blocks_needed([(seq, 10)]) == 3
    _grow(bm, seq, 10)
    assert len(seq.block_ids) == 3 and bm.device.num_free == 5
    seq.token_ids += [1, 2]
    assert bm.blocks_needed([(seq, 2)]) == 0  # fits the third block
    _grow(bm, seq, 2)
    seq.token_ids.append(3)
    assert bm.blocks_needed([(seq, 1)]) == 1
    bm.free(seq)
    assert bm.device.num_free == 8 and seq.block_ids == [] and seq.num_computed == 0


def test_fork_shares_blocks_and_copies_on_first_divergent_write():
    bm = BlockManager(8, 0, block_size=4)
    parent = _seq(range(6))
    _grow(bm, parent, 6)  # blocks: one full, one with 2 tokens
    child = _seq(range(6), seq_id=1, request=parent.request)
    bm.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert [bm.device.ref_counts[b] for b in parent.block_ids] == [2, 2]
    for seq, token in ((parent, 50), (child, 60)):
        seq.token_ids.append(token)
    assert bm.blocks_needed([(parent, 1)]) == 1  # the shared partial block must be copied
    assert bm.blocks_needed([(parent, 1), (child, 1)]) == 1  # the last writer needs no copy
    bm.allocate(parent, 1)
    copies = bm.take_pending_copies()
    assert copies == [(child.block_ids[1], parent.block_ids[1])]
    bm.allocate(child, 1)  # now the only holder: written in place
    assert bm.take_pending_copies() == []
    assert parent.block_ids[0] == child.block_ids[0]  # the full block stays shared
    assert bm.device.ref_counts[parent.block_ids[0]] == 2
    bm.free(parent)
    bm.free(child)
    assert bm.device.num_free == 8


def test_prefix_cache_hits_full_blocks_and_keeps_two_tokens_to_compute():
    """Two: a one-token step would run the attention kernel's decode path, whose sums round
    differently from the prefill path that computed the prompt whole."""
    bm = BlockManager(8, 0, block_size=4)
    first = _seq(range(12))
    _grow(bm, first, 12)
    same = _seq(range(12), seq_id=1)
    # Three full blocks are cached, but the last two tokens must be computed: two hits.
    assert bm.match_prefix(same) == first.block_ids[:2]
    one_more = _seq([*range(12), 99], seq_id=5)
    assert bm.match_prefix(one_more) == first.block_ids[:2]
    longer = _seq([*range(12), 99, 98], seq_id=2)
    assert bm.match_prefix(longer) == first.block_ids[:3]
    diverging = _seq([0, 1, 2, 3, 4, 5, 6, 0, 8, 9], seq_id=3)
    assert bm.match_prefix(diverging) == first.block_ids[:1]
    # A block with the same tokens after a different prefix is not a hit.
    shifted = _seq([7, 7, 7, 7, 4, 5, 6, 7, 1], seq_id=4)
    assert bm.match_prefix(shifted) == []

    bm.take_prefix(longer, bm.match_prefix(longer))
    assert longer.num_computed == 12
    assert [bm.device.ref_counts[b] for b in first.block_ids] == [2, 2, 2]


def test_freed_cached_blocks_stay_hittable_until_evicted_lru():
    bm = BlockManager(4, 0, block_size=2)
    a = _seq([1, 2, 3, 4, 5])
    _grow(bm, a, 4)  # two full blocks
    bm.free(a)
    assert bm.device.num_free == 4 and bm.device.num_cached == 2
    b = _seq([1, 2, 3, 4, 9, 10], seq_id=1)
    hits = bm.match_prefix(b)
    assert len(hits) == 2 and all(bm.device.is_evictable(h) for h in hits)
    # Allocation prefers never-cached blocks, then evicts the least recently freed (the tail
    # block of `a` was freed first).
    taken = [bm.device.allocate() for _ in range(3)]
    assert hits[1] in taken and hits[0] not in taken
    assert bm.match_prefix(b) == hits[:1]


def test_swap_out_and_in_keeps_sharing_and_leaves_other_requests_blocks():
    bm = BlockManager(8, 8, block_size=4)
    other = _seq(range(8), seq_id=9)
    _grow(bm, other, 8)
    parent = _seq(range(10))
    bm.take_prefix(parent, bm.match_prefix(parent))  # shares `other`'s first two blocks
    _grow(bm, parent, 2)
    child = _seq(range(10), seq_id=1, request=parent.request)
    bm.fork(parent, child)
    distinct = set(parent.block_ids)
    assert bm.can_swap_out([parent, child])

    moves = bm.swap_out([parent, child])
    assert sorted(src for src, _ in moves) == sorted(distinct)
    assert parent.block_ids == child.block_ids  # still shared, now in the CPU pool
    assert [bm.cpu.ref_counts[b] for b in parent.block_ids] == [2, 2, 2]
    assert [bm.device.ref_counts[b] for b in other.block_ids] == [1, 1]  # untouched
    assert bm.device.num_free == 8 - 2

    assert bm.swap_in_cost([parent, child]) == 3
    back = bm.swap_in([parent, child])
    assert len(back) == 3 and bm.cpu.num_free == 8
    assert [bm.device.ref_counts[b] for b in parent.block_ids] == [2, 2, 2]
    for seq in (parent, child, other):
        bm.free(seq)
    assert bm.device.num_free == 8


def test_admitting_samples_never_evicts_a_hit_another_sample_is_about_to_take():
    # Two samples of one request, freed by a recomputation, each with one cached full block
    # that nobody holds; the pool's other blocks are cached too, so every allocation evicts
    # the least recently freed one.
    bm = BlockManager(4, 0, block_size=2)
    request = Request("r", [1], SamplingParams(n=2), 0)
    first, second = _seq([1, 5, 6, 9], 0, request), _seq([1, 7, 8, 9], 1, request)
    others = [_seq([2, 2], 2), _seq([3, 3], 3)]
    for seq in (first, second, *others):
        _grow(bm, seq, 2)
    held = [first.block_ids[0], second.block_ids[0]]
    for seq in (first, second, *others):
        bm.free(seq)
    plan = [(first, 1), (second, 1)]
    hits = [bm.match_prefix(first), bm.match_prefix(second)]
    assert hits == [[held[0]], [held[1]]]
    assert bm.admission_cost(plan, hits) == 4 == bm.device.num_free
    bm.admit(request, plan, hits)
    assert first.block_ids[0] == held[0] and second.block_ids[0] == held[1]
    assert len({b for seq in (first, second) for b in seq.block_ids}) == 4


def test_samples_hitting_the_same_unheld_block_count_it_once():
    bm = BlockManager(4, 0, block_size=2)
    request = Request("r", [1], SamplingParams(n=2), 0)
    first, second = _seq([1, 5, 6, 9], 0, request), _seq([1, 5, 7, 9], 1, request)
    _grow(bm, first, 3)
    bm.free(first)
    plan = [(first, 1), (second, 1)]
    hits = [bm.match_prefix(first), bm.match_prefix(second)]
    assert hits[0] == hits[1] and len(hits[0]) == 1
    assert bm.admission_cost(plan, hits) == 3  # the shared hit once, one new block each
    bm.admit(request, plan, hits)
    assert bm.device.ref_counts[hits[0][0]] == 2 and bm.device.num_free == 1


def test_prefix_cache_keys_carry_the_rope_regime():
    """LongRoPE (switch 10): blocks computed at or below the switch (short factors) are never
    hits of a sequence longer than it (computed with the long factors), nor the other way
    round; the same regime hits."""
    bm = BlockManager(32, 4, 4, rope_switch_length=10)
    short = _seq(range(8))
    _grow(bm, short, 8)
    assert bm.match_prefix(_seq([*range(8), 50, 51], 1)) == short.block_ids[:2]  # 10 <= 10
    grown = _seq([*range(8), 50, 51, 52, 53], 2)  # 12 > 10: computed long
    assert bm.match_prefix(grown) == []
    long = _seq(range(100, 114), 3)
    long.long_rope = True  # as the scheduler marks it when it plans a chunk past the switch
    _grow(bm, long, 14)
    assert bm.match_prefix(_seq(range(100, 114), 4)) == long.block_ids[:3]
    below = _seq(range(100, 109), 5)  # 9 tokens: short
    assert bm.match_prefix(below) == []
    below.token_ids += [108, 109, 110]  # it grew past the switch: its short keys are dropped
    assert bm.match_prefix(below) == long.block_ids[:2]
