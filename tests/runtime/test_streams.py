"""Streams and failures release what they hold: a ``stream()`` closed, deleted or interrupted
aborts its requests and frees their blocks; streams consumed alternately each deliver every token
and their finished update; a step whose executor raises fails its requests (blocks freed, error
set), raises on, and leaves the engine usable. On the exact checksum model (any mis-managed block
changes the tokens)."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig, TorchExecutor
from tests.runtime.echo_decoder import EchoDecoder

MODEL = EchoDecoder()
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 9, 9, 1, 2, 3, 4]]
PARAMS = SamplingParams(max_tokens=10, n=2, temperature=0.8, seed=7)


class FaultyExecutor(TorchExecutor):
    """A real executor whose ``fail_at``-th model run (counted from 1) raises ``error``."""

    def __init__(self, error: BaseException, fail_at: int) -> None:
        super().__init__(MODEL, cache_spec=MODEL.cache_spec(2))
        self.error, self.fail_at, self.calls = error, fail_at, 0

    def execute_numpy(self, model_input):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return super().execute_numpy(model_input)


def _engine(executor: TorchExecutor | None = None, max_num_seqs: int = 8) -> Engine:
    executor = executor or TorchExecutor(MODEL, cache_spec=MODEL.cache_spec(2))
    cache = CacheConfig(num_blocks=48, num_cpu_blocks=8)
    return Engine(executor, cache, SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=32))


def _solo(prompt: list[int], params: SamplingParams = PARAMS) -> list[list[int]]:
    return [c.token_ids for c in _engine().generate([prompt], params)[0].outputs]


def _assert_released(engine: Engine) -> None:
    """No block is held, no request is queued or remembered."""
    bm = engine.block_manager
    assert bm.device.num_free == engine.num_blocks and not any(bm.device.ref_counts)
    assert bm.cpu.num_free == engine.num_cpu_blocks and not any(bm.cpu.ref_counts)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_usage()["blocks_in_use"] == 0


def _assert_usable(engine: Engine) -> None:
    outputs = engine.generate(PROMPTS[:2], PARAMS)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [_solo(p) for p in PROMPTS[:2]]
    _assert_released(engine)


def _started(engine: Engine):
    stream = engine.stream(PROMPTS, PARAMS)
    first = next(stream)
    assert first.outputs[0].new_token_ids  # a token is out, the requests hold blocks
    assert engine.kv_cache_usage()["blocks_in_use"] > 0
    return stream


def test_a_stream_closed_after_its_first_token_frees_every_block():
    engine = _engine()
    _started(engine).close()
    _assert_released(engine)
    _assert_usable(engine)


def test_a_deleted_stream_frees_every_block():
    engine = _engine()
    stream = _started(engine)
    del stream
    gc.collect()
    _assert_released(engine)
    _assert_usable(engine)


def test_an_exception_thrown_into_a_stream_frees_every_block():
    engine = _engine()
    stream = _started(engine)
    with pytest.raises(KeyboardInterrupt):
        stream.throw(KeyboardInterrupt)
    _assert_released(engine)
    _assert_usable(engine)


def test_aborted_forked_samples_give_back_their_sequence_slots():
    # Two slots: a leaked slot of an aborted n=2 request would keep the next one out forever.
    engine = _engine(max_num_seqs=2)
    for _ in range(3):
        request_id = engine.add_request(PROMPTS[0], PARAMS)
        engine.step()
        engine.step()  # the samples have forked
        engine.abort(request_id)
        assert engine.get_output(request_id).outputs[1].finish_reason == "aborted"
        engine.release(request_id)
    output = engine.generate([PROMPTS[1]], PARAMS)[0]
    assert output.error is None and [c.token_ids for c in output.outputs] == _solo(PROMPTS[1])
    _assert_released(engine)


@pytest.mark.parametrize("max_tokens", [(2, 10), (3, 3), (4, 3), (10, 9), (10, 4)])
def test_interleaved_streams_each_deliver_their_solo_tokens_and_finished_update(max_tokens):
    engine = _engine()
    params = [dataclasses.replace(PARAMS, max_tokens=m) for m in max_tokens]
    streams = [engine.stream(PROMPTS[:2], params[0]), engine.stream(PROMPTS[2:], params[1])]
    tokens: dict[str, dict[int, list[int]]] = {}
    finished: dict[str, list[list[int]]] = {}
    while streams:
        for stream in list(streams):
            update = next(stream, None)
            if update is None:
                streams.remove(stream)
                continue
            assert update.request_id not in finished  # nothing after the finished update
            for sample in update.outputs:
                tokens.setdefault(update.request_id, {}).setdefault(sample.index, [])
                tokens[update.request_id][sample.index] += sample.new_token_ids
            if update.finished:
                finished[update.request_id] = [c.token_ids for c in update.outputs]
    solo = [_solo(p, params[0]) for p in PROMPTS[:2]] + [_solo(PROMPTS[2], params[1])]
    assert sorted(finished.values()) == sorted(solo)
    for request_id, samples in tokens.items():
        assert [samples[i] for i in sorted(samples)] == finished[request_id]
    _assert_released(engine)


def test_a_stream_delivers_what_a_generate_call_ran_for_it():
    engine = _engine()
    stream = engine.stream([PROMPTS[0]], PARAMS)
    first = next(stream)
    # generate runs the stream's request to its end while the stream waits.
    longer = dataclasses.replace(PARAMS, max_tokens=16)
    assert engine.generate([PROMPTS[2]], longer)[0].outputs[0].finish_reason == "length"
    rest = list(stream)
    (last,) = rest
    assert last.finished
    pairs = zip(first.outputs, last.outputs, strict=True)
    delivered = [a.new_token_ids + b.new_token_ids for a, b in pairs]
    assert delivered == [c.token_ids for c in last.outputs] == _solo(PROMPTS[0])
    _assert_released(engine)


def test_a_request_aborted_while_streamed_gets_its_finished_update():
    engine = _engine()
    stream = engine.stream(PROMPTS[:2], PARAMS)
    first = next(stream)
    engine.abort(first.request_id)
    (aborted,) = [u for u in stream if u.request_id == first.request_id]
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["aborted"] * 2
    _assert_released(engine)


@pytest.mark.parametrize("fail_at", [1, 3])
def test_an_executor_exception_fails_the_step_requests_and_frees_their_blocks(fail_at):
    engine = _engine(FaultyExecutor(RuntimeError("device lost"), fail_at))
    ids = [engine.add_request(prompt, PARAMS) for prompt in PROMPTS]
    with pytest.raises(RuntimeError, match="device lost"):
        while engine.has_unfinished_requests():
            engine.step()
    for request_id in ids:
        output = engine.get_output(request_id)
        assert output.finished and output.finish_reason == "error"
        assert "the executor failed: RuntimeError: device lost" in output.error
        assert output.error_is_internal  # the engine's fault: a server answers 500
        engine.release(request_id)
    _assert_released(engine)
    _assert_usable(engine)


def test_an_executor_exception_in_generate_aborts_its_other_requests():
    engine = _engine(FaultyExecutor(RuntimeError("device lost"), 2), max_num_seqs=2)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(PROMPTS, PARAMS)  # the third request is still queued at step 2
    _assert_released(engine)
    _assert_usable(engine)


def test_an_executor_exception_reaches_an_interleaved_stream_as_an_error():
    engine = _engine(FaultyExecutor(RuntimeError("device lost"), 3))
    first, second = engine.stream(PROMPTS[:1], PARAMS), engine.stream(PROMPTS[1:2], PARAMS)
    next(first), next(second)
    with pytest.raises(RuntimeError, match="device lost"):
        list(first)
    (last,) = list(second)  # the failed step ran both streams' requests
    assert last.finished and "RuntimeError: device lost" in last.error
    _assert_released(engine)
    _assert_usable(engine)


def test_an_interrupt_inside_the_executor_reaches_the_stream_and_frees_every_block():
    engine = _engine(FaultyExecutor(KeyboardInterrupt(), 3))
    with pytest.raises(KeyboardInterrupt):
        for _ in engine.stream(PROMPTS, PARAMS):
            pass
    _assert_released(engine)
    _assert_usable(engine)
