"""The engine end to end on a small paged decoder: batching, preemption, prefix caching,
forks, accounting, streaming and per-request errors."""

from __future__ import annotations

import pytest

from attnexport.models import load_model
from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig, TorchExecutor

BLOCK_SIZE = 4
MAX_MODEL_LEN = 256

PROMPTS = [
    [5, 17, 3, 88, 41, 9, 60],
    [12, 2],
    list(range(20, 45)),
    [7, 7, 1, 90, 33, 12, 4, 81, 15, 16, 23, 42, 8],
]


@pytest.fixture(scope="module")
def model():
    """The zoo's tiny Llama (2 layers, GQA 4/2, vocab 256), seeded weights."""
    return load_model("llama")


def _engine(model, num_blocks=64, prefix_caching=True, **scheduler) -> Engine:
    scheduler.setdefault("max_model_len", MAX_MODEL_LEN)
    cache = CacheConfig(
        num_blocks=num_blocks, num_cpu_blocks=64, enable_prefix_caching=prefix_caching
    )
    executor = TorchExecutor(model, block_size=BLOCK_SIZE)
    return Engine(executor, cache, SchedulerConfig(**scheduler))


def _assert_all_blocks_free(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.device.num_free == engine.num_blocks
    assert bm.cpu.num_free == engine.num_cpu_blocks
    assert not any(bm.device.ref_counts) and not any(bm.cpu.ref_counts)


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    """Greedy tokens of each prompt run by itself."""
    params = SamplingParams(max_tokens=12)
    return [_engine(model).generate([p], params)[0].token_ids for p in PROMPTS]


def test_batched_chunked_greedy_matches_each_request_alone(model, alone):
    engine = _engine(model, max_num_batched_tokens=10)  # the 25-token prompt takes 3 chunks
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outputs] == alone
    assert all(o.finish_reason == "length" and o.error is None for o in outputs)
    assert engine.stats.num_prompt_tokens_computed == sum(map(len, PROMPTS))
    first = outputs[0].metrics
    assert first.arrival_time <= first.first_scheduled_time <= first.first_token_time
    assert first.first_token_time <= first.finish_time
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_a_pool_too_small_for_the_batch_preempts_and_keeps_outputs(model, alone, mode):
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=30, seed=3, n=2)
    greedy = SamplingParams(max_tokens=12)
    # 14 blocks of 4 tokens: the batch needs ~25 at its peak.
    engine = _engine(model, num_blocks=14, preemption_mode=mode, max_model_len=40)
    outputs = engine.generate([*PROMPTS, PROMPTS[0]], [greedy] * 4 + [sampled])
    stats = engine.stats
    assert stats.num_preemptions > 0
    if mode == "swap":
        assert stats.num_swapped_out_blocks > 0 and stats.num_swapped_in_blocks > 0
    else:
        assert stats.num_swapped_out_blocks == 0
        assert stats.num_computed_tokens > sum(map(len, PROMPTS)) + len(PROMPTS[0]) + 11 * 6
    assert [o.token_ids for o in outputs[:4]] == alone
    reference = _engine(model).generate([PROMPTS[0]], sampled)[0]
    assert [c.token_ids for c in outputs[4].outputs] == [c.token_ids for c in reference.outputs]
    _assert_all_blocks_free(engine)


def test_prefix_cache_hit_skips_prefill_work(model):
    shared = list(range(30, 46))  # four full blocks of 4
    first, second = [*shared, 1, 2], [*shared, 9, 8]
    engine = _engine(model)
    expected = _engine(model).generate([second], SamplingParams(max_tokens=6))[0].token_ids
    engine.generate([first], SamplingParams(max_tokens=6))
    engine.reset_stats()
    output = engine.generate([second], SamplingParams(max_tokens=6))[0]
    assert output.metrics.num_cached_prompt_tokens == 16
    # Only the two tokens after the prefix (two: their rows then run the prefill path).
    assert engine.stats.num_prompt_tokens_computed == 2
    assert output.token_ids == expected
    without = _engine(model, prefix_caching=False)
    without.generate([first], SamplingParams(max_tokens=6))
    without.reset_stats()
    assert without.generate([second], SamplingParams(max_tokens=6))[0].token_ids == expected
    assert without.stats.num_prompt_tokens_computed == len(second)
    _assert_all_blocks_free(engine)


def test_fork_shares_prompt_blocks_and_copies_on_write(model):
    engine = _engine(model)
    prompt = PROMPTS[2]  # 25 tokens: six full blocks and one with one token
    engine.add_request(prompt, SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=2))
    (update,) = engine.step()  # prefill, then fork
    assert len(update.outputs) == 2 and not update.finished
    assert engine.kv_cache_usage()["tokens_stored"] == 2 * len(prompt)
    request = next(iter(engine._requests.values()))
    first, second = request.seqs
    assert first.block_ids == second.block_ids
    assert all(engine.block_manager.device.ref_counts[b] == 2 for b in first.block_ids)
    assert engine.stats.num_computed_tokens == len(prompt)
    engine.step()  # both write their first sampled token into the shared last block
    assert engine.stats.num_copied_blocks == 1
    assert first.block_ids[:-1] == second.block_ids[:-1]
    assert first.block_ids[-1] != second.block_ids[-1]
    while engine.has_unfinished_requests():
        engine.step()
    output = engine.get_output(request.request_id)
    assert len(output.outputs) == 2 and output.outputs[0].token_ids != output.outputs[1].token_ids
    _assert_all_blocks_free(engine)


def test_bad_requests_fail_alone_and_the_others_complete(model, alone):
    engine = _engine(model)
    max_len = engine.max_model_len
    vocab = model.config.vocab_size
    cases = [
        ([], SamplingParams(), "prompt: expected at least one token"),
        ([1] * (max_len + 1), SamplingParams(), "longer than the model's maximum length"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens: expected an int >= 1"),
        ([1, vocab], SamplingParams(), rf"token id {vocab} is outside the vocabulary"),
        ([1, -3], SamplingParams(), "token id -3 is outside the vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=(2, vocab)), rf"stop_token_ids: token id {vocab}"),
        ([1, 2.5], SamplingParams(), "prompt: expected int token ids"),
    ]
    prompts = [PROMPTS[0]] + [c[0] for c in cases] + [PROMPTS[1]]
    params = [SamplingParams(max_tokens=12)] + [c[1] for c in cases] + [SamplingParams(12)]
    outputs = engine.generate(prompts, params)
    assert outputs[0].token_ids == alone[0] and outputs[-1].token_ids == alone[1]
    for output, (_, _, message) in zip(outputs[1:-1], cases, strict=True):
        assert output.finish_reason == "error" and output.token_ids == []
        assert output.error is not None
        assert __import__("re").search(message, output.error), output.error
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.add_request([])
    _assert_all_blocks_free(engine)


def test_stop_tokens_max_model_len_and_streaming(model, alone):
    engine = _engine(model)
    stop = alone[0][3]
    params = [SamplingParams(max_tokens=12, stop_token_ids=[stop]), SamplingParams(max_tokens=12)]
    updates = list(engine.stream([PROMPTS[0], PROMPTS[1]], params))
    streamed: dict[str, list[int]] = {}
    for update in updates:
        streamed.setdefault(update.request_id, []).extend(update.outputs[0].new_token_ids)
    first, second = (u for u in updates if u.finished)
    assert first.token_ids == alone[0][: alone[0].index(stop) + 1]
    assert first.finish_reason == "stop" and second.finish_reason == "length"
    assert streamed[first.request_id] == first.token_ids
    assert streamed[second.request_id] == alone[1]

    short = _engine(model, max_model_len=9)
    output = short.generate([PROMPTS[0]], SamplingParams(max_tokens=12))[0]
    assert output.token_ids == alone[0][:2] and output.finish_reason == "length"


def test_seeded_sampling_does_not_depend_on_the_batch(model):
    params = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.95, seed=123)
    alone = _engine(model).generate([PROMPTS[3]], params)[0].token_ids
    batch = _engine(model, max_num_batched_tokens=8).generate(
        [PROMPTS[0], PROMPTS[3], PROMPTS[2]],
        [SamplingParams(temperature=1.0), params, SamplingParams(max_tokens=3)],
    )
    assert batch[1].token_ids == alone
    unseeded = SamplingParams(max_tokens=8, temperature=5.0)
    runs = {tuple(_engine(model).generate([PROMPTS[3]], unseeded)[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_default_sizing_fits_the_machine(model):
    engine = Engine(TorchExecutor(model))
    spec = engine.executor.cache_spec
    assert engine.max_model_len == model.config.max_position_embeddings
    assert spec == model.cache_spec(16)
    assert engine.num_blocks >= -(-engine.max_model_len // spec.block_size)
    assert engine.executor.kv_caches[0].shape == spec.cache_shape(engine.num_blocks)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=2048"):
        Engine(TorchExecutor(model), CacheConfig(num_blocks=10))
    budget = CacheConfig(memory_bytes=200 * spec.bytes_per_block + 5)
    assert Engine(TorchExecutor(model), budget).num_blocks == 200


def test_abort_frees_the_request_and_leaves_the_others(model, alone):
    engine = _engine(model)
    kept = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=12))
    dropped = engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12, n=2))
    engine.step()
    engine.step()
    engine.abort(dropped)
    output = engine.get_output(dropped)
    assert output.finished and [c.finish_reason for c in output.outputs] == ["aborted"] * 2
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_output(kept).token_ids == alone[0]
    _assert_all_blocks_free(engine)


FORKED_PROMPTS = [[5, 17, 3], [12, 2], [7, 7, 1, 90, 33, 12, 4, 81, 15], [1, 2]]
FORKED_PARAMS = [
    SamplingParams(max_tokens=16, n=6, temperature=1.0, seed=100 + i) for i in range(4)
]


@pytest.fixture(scope="module")
def forked_alone(model) -> list[list[list[int]]]:
    """The samples of each seeded n=6 request run by itself."""
    return [
        [c.token_ids for c in _engine(model).generate([prompt], params)[0].outputs]
        for prompt, params in zip(FORKED_PROMPTS, FORKED_PARAMS, strict=True)
    ]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_seeded_samples_under_memory_pressure_equal_their_solo_run(
    model, forked_alone, mode
):
    # 24 samples in a pool that holds about one request's: samples are preempted, recomputed
    # over their own cached blocks (swap mode falls back to it: 4 CPU blocks) and must each
    # read only their own keys and values.
    cache = CacheConfig(num_blocks=40, num_cpu_blocks=4)
    scheduler = SchedulerConfig(max_model_len=64, preemption_mode=mode)
    engine = Engine(TorchExecutor(model, block_size=BLOCK_SIZE), cache, scheduler)
    outputs = engine.generate(FORKED_PROMPTS, FORKED_PARAMS)
    assert engine.stats.num_preemptions > 0
    assert [[c.token_ids for c in o.outputs] for o in outputs] == forked_alone
    _assert_all_blocks_free(engine)
