"""The scheduler without a model: token and sequence budgets, chunked prefill, preemption."""

from __future__ import annotations

import pytest

from attnexport.runtime.block_manager import BlockManager
from attnexport.runtime.config import CacheConfig, SchedulerConfig
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.scheduler import Scheduler
from attnexport.runtime.sequence import Request, SequenceState, Status


def _scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    bm = BlockManager(num_blocks, 16, block_size, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(**config), bm)


def _add(scheduler: Scheduler, prompt_len: int, index: int) -> Request:
    request = Request(f"r{index}", list(range(prompt_len)), SamplingParams(), index)
    request.seqs.append(SequenceState(index, request, list(range(prompt_len)), 0, None))
    scheduler.add(request)
    return request


def _step(scheduler: Scheduler) -> dict[str, int]:
    """Schedules a step, pretends the model ran, appends a token to completed sequences;
    returns tokens per request id."""
    batch = scheduler.schedule()
    for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed += count
        if seq.num_computed == len(seq.token_ids):
            seq.token_ids.append(1)
    pairs = zip(batch.seqs, batch.num_new_tokens, strict=True)
    return {seq.request.request_id: n for seq, n in pairs}


def test_chunked_prefill_fills_the_token_budget_after_decodes():
    scheduler = _scheduler(max_num_batched_tokens=8)
    _add(scheduler, 10, 0)
    _add(scheduler, 8, 1)
    assert _step(scheduler) == {"r0": 8}
    assert _step(scheduler) == {"r0": 2, "r1": 6}
    assert _step(scheduler) == {"r0": 1, "r1": 2}  # r0 decodes, r1 finishes its prompt
    assert _step(scheduler) == {"r0": 1, "r1": 1}


def test_a_prompt_never_computes_or_leaves_a_one_token_chunk():
    """A one-token step of a sequence runs the attention kernel's decode path (it rounds
    otherwise than the prefill path): a chunk that would leave one token of a prompt leaves
    two, and a room of one token waits for the next step."""
    scheduler = _scheduler(max_num_batched_tokens=8)
    _add(scheduler, 10, 0)
    _add(scheduler, 7, 1)
    assert _step(scheduler) == {"r0": 8}
    assert _step(scheduler) == {"r0": 2, "r1": 5}  # 6 would leave one token of r1's 7
    assert _step(scheduler) == {"r0": 1, "r1": 2}
    # (uncomputed tokens, room) -> tokens computed: a room of one token waits for a step.
    chunks = {(5, 1): 0, (3, 2): 0, (7, 6): 5, (7, 7): 7, (1, 1): 1, (9, 4): 4}
    assert {key: scheduler._chunk(*key) for key in chunks} == chunks
    assert _scheduler(max_num_batched_tokens=2)._chunk(3, 2) == 2  # a budget under 3: as it falls


def test_a_prompt_chunk_leaves_the_reserve_to_waiting_requests():
    scheduler = _scheduler(max_num_batched_tokens=8)  # reserve: half of it
    _add(scheduler, 20, 0)
    assert _step(scheduler) == {"r0": 8}  # nothing waits: the whole budget
    _add(scheduler, 3, 1)
    assert _step(scheduler) == {"r0": 4, "r1": 3}
    assert _step(scheduler) == {"r0": 8}  # nothing waits: the older request's chunk first


def test_the_reserve_is_not_held_for_a_request_that_cannot_start():
    scheduler = _scheduler(max_num_batched_tokens=8, max_num_seqs=1)
    _add(scheduler, 20, 0)
    _step(scheduler)
    _add(scheduler, 3, 1)
    assert _step(scheduler) == {"r0": 8}


def test_without_chunking_a_prompt_waits_until_it_fits_whole():
    scheduler = _scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    _add(scheduler, 6, 0)
    _add(scheduler, 5, 1)
    assert _step(scheduler) == {"r0": 6}
    assert _step(scheduler) == {"r0": 1, "r1": 5}


def test_max_num_seqs_limits_running_sequences():
    scheduler = _scheduler(max_num_seqs=2)
    for i in range(3):
        _add(scheduler, 3, i)
    assert _step(scheduler) == {"r0": 3, "r1": 3}
    assert _step(scheduler) == {"r0": 1, "r1": 1}
    scheduler.finish(scheduler.running[0])
    assert _step(scheduler) == {"r1": 1, "r2": 3}


def test_preemption_evicts_the_youngest_running_request():
    # 5 blocks of 4 tokens: two sequences of 8 tokens fill 4; growing both needs 6.
    for mode in ("recompute", "swap"):
        scheduler = _scheduler(num_blocks=5, preemption_mode=mode)
        old, young = _add(scheduler, 8, 0), _add(scheduler, 8, 1)
        assert _step(scheduler) == {"r0": 8, "r1": 8}
        assert _step(scheduler) == {"r0": 1}  # r1 is evicted to give r0 a new block
        assert old.status == Status.RUNNING and young.num_preemptions == 1
        if mode == "swap":
            assert young.status == Status.SWAPPED and young.seqs[0].num_computed == 8
        else:
            assert young.status == Status.WAITING and young.seqs[0].num_computed == 0
        scheduler.finish(old)
        expected = 1 if mode == "swap" else 9  # recompute: prompt + its first token again
        assert _step(scheduler) == {"r1": expected}
        assert scheduler.block_manager.device.num_free == 5 - 3


def test_a_request_larger_than_the_pool_fails_alone():
    scheduler = _scheduler(num_blocks=3, max_num_batched_tokens=64)
    request = _add(scheduler, 12, 0)
    request.params = SamplingParams(n=2)  # two samples of 12+ tokens cannot share 3 blocks
    _step(scheduler)  # prefill: 3 blocks
    request.seqs.append(SequenceState(1, request, list(request.seqs[0].token_ids), 1, None))
    scheduler.block_manager.fork(request.seqs[0], request.seqs[1])
    request.seqs[1].token_ids[-1] = 2
    batch = scheduler.schedule()
    assert batch.failed == [request] and "more KV-cache blocks than the pool" in request.error
    assert scheduler.block_manager.device.num_free == 3


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs: expected a positive int"),
        (lambda: SchedulerConfig(max_model_len=-4), "max_model_len: expected a positive int"),
        (lambda: SchedulerConfig(preemption_mode="drop"), "expected 'swap' or 'recompute'"),
        (
            lambda: SchedulerConfig(max_num_batched_tokens=64, waiting_reserve_tokens=64),
            "waiting_reserve_tokens: 64 leaves no token",
        ),
        (
            lambda: SchedulerConfig(waiting_reserve_tokens=-1),
            "waiting_reserve_tokens: expected a non-negative int",
        ),
        (lambda: CacheConfig(num_blocks=-1), "num_blocks: expected a non-negative int"),
        (lambda: CacheConfig(swap_space_bytes=1.5), "swap_space_bytes: expected a non-negative"),
    ],
)
def test_bad_configs_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---------------------------------------------------------------- LongRoPE switch length


def _rope_scheduler(switch: int, num_blocks=64, **config) -> Scheduler:
    bm = BlockManager(num_blocks, 16, 4, enable_prefix_caching=False, rope_switch_length=switch)
    return Scheduler(SchedulerConfig(**config), bm, rope_switch_length=switch)


def test_a_sequence_growing_past_the_rope_switch_is_recomputed_whole_in_one_step():
    """At the step its length first exceeds the switch (10) with a cache computed at or below
    it, a request is preempted by recomputation (its blocks go back to the pool) and computed
    again over all its tokens in that same step; the other request decodes on, and is
    recomputed in turn when it crosses."""
    scheduler = _rope_scheduler(10, max_num_batched_tokens=32)
    r0, r1 = _add(scheduler, 7, 0), _add(scheduler, 3, 1)
    assert _step(scheduler) == {"r0": 7, "r1": 3}
    for _ in range(3):
        assert _step(scheduler) == {"r0": 1, "r1": 1}
    seq = r0.seqs[0]
    assert (seq.num_computed, len(seq.token_ids), seq.long_rope) == (10, 11, False)
    old_blocks = list(seq.block_ids)
    batch = scheduler.schedule()
    assert batch.recomputed == [r0] and batch.preempted == [] and r0.num_preemptions == 1
    ids = [s.request.request_id for s in batch.seqs]
    # r0 computes every token again: all its keys get the long factors
    assert dict(zip(ids, batch.num_new_tokens, strict=True)) == {"r1": 1, "r0": 11}
    # (its freed blocks are the first ones handed out again: it takes them back)
    assert seq.long_rope and set(seq.block_ids) == set(old_blocks)
    assert scheduler.block_manager.num_used_blocks() == 3 + 2  # the old 3 blocks were freed
    for s, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
        s.num_computed += count
        s.token_ids.append(1)
    assert _step(scheduler) == {"r0": 1, "r1": 1}  # long now: no second recomputation
    steps = [_step(scheduler) for _ in range(3)]
    assert steps[-1] == {"r0": 1, "r1": 11} and r1.seqs[0].long_rope


def test_a_prompt_longer_than_the_rope_switch_is_never_chunked_below_it():
    """A chunk of a sequence longer than the switch ends past it: with 8 tokens of the budget
    left (a chunk ending at 8 <= 10) the 14-token prompt waits; with 11 left it starts."""
    scheduler = _rope_scheduler(10, max_num_batched_tokens=12)
    _add(scheduler, 4, 0)
    _add(scheduler, 14, 1)
    assert _step(scheduler) == {"r0": 4}  # not {"r0": 4, "r1": 8}
    assert _step(scheduler) == {"r0": 1, "r1": 11}
    assert _step(scheduler) == {"r0": 1, "r1": 3}


def test_a_swapped_request_that_crossed_the_rope_switch_is_recomputed_not_swapped_in():
    """Swapped out for blocks at the step it would cross the switch, a request is not brought
    back with its short-regime keys: its CPU blocks are dropped and it waits to be computed
    again."""
    scheduler = _rope_scheduler(10, num_blocks=6, max_num_batched_tokens=32, preemption_mode="swap")
    bm = scheduler.block_manager
    _add(scheduler, 7, 0)
    r1 = _add(scheduler, 5, 1)
    for _ in range(7):
        _step(scheduler)
    seq = r1.seqs[0]
    assert r1.status == Status.SWAPPED and (seq.num_computed, len(seq.token_ids)) == (10, 11)
    assert bm.cpu.num_free == 16 - 3
    batch = scheduler.schedule()
    assert batch.recomputed == [r1] and batch.swap_in == []
    assert r1.status == Status.WAITING and seq.num_computed == 0 and not seq.block_ids
    assert bm.cpu.num_free == 16
