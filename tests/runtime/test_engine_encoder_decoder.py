"""The engine on an encoder-decoder (the zoo's BART): the encoder runs in the step that admits
a request, its cross blocks are freed with it, batching and preemption keep every request's
tokens, and forced BOS/EOS tokens behave as transformers' generate."""

from __future__ import annotations

import dataclasses

import pytest

from attnexport.models import load_model
from attnexport.models.bart import BartConfig, BartForConditionalGeneration
from attnexport.runtime import (
    CacheConfig,
    EncoderDecoderConfig,
    Engine,
    SamplingParams,
    SchedulerConfig,
    TorchExecutor,
)
from attnexport.runtime.sequence import EncoderInput, Request, SequenceState
from attnexport.runtime.torch_inputs import StepTensors
from tests.models.hf_reference import tiny_bart

BLOCK_SIZE = 4
START = 2
PROMPTS = [
    [0, 8, 15, 22, 9, 2],
    [0, *range(30, 51), 2],
    [5, 1, 7],
    [0, 60, 61, 62, 63, 64, 65, 66, 67, 68, 2],
    [9],
]
GREEDY = SamplingParams(max_tokens=10)
# Random BART decoders tend to repeat one greedy token; seeded sampling draws on the whole
# distribution, so a wrong cross or self block shows in the tokens (and does not depend on
# the batch, see attnexport.runtime.sampling).
SEEDED = [SamplingParams(max_tokens=10, temperature=1.0, seed=i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 2 + 2-layer BART (d_model 32, vocab 120) from a transformers checkpoint."""
    path = tmp_path_factory.mktemp("bart")
    tiny_bart(path)
    return load_model(path)


def _engine(model, num_blocks=64, **scheduler) -> Engine:
    scheduler.setdefault("max_model_len", 64)
    executor = TorchExecutor(model, block_size=BLOCK_SIZE)
    cache = CacheConfig(num_blocks=num_blocks, num_cpu_blocks=64)
    return Engine(executor, cache, SchedulerConfig(**scheduler), EncoderDecoderConfig(START))


def _assert_all_blocks_free(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.device.num_free == bm.cross.num_free == engine.num_blocks
    assert bm.cpu.num_free == engine.num_cpu_blocks
    assert not any(bm.device.ref_counts) and not any(bm.cross.ref_counts)


def _recorded(engine: Engine) -> list:
    """Wraps the executor so that every step's model input is kept (as its tensors)."""
    inputs, execute = [], engine.executor.execute

    def record(model_input):
        inputs.append(StepTensors(model_input))
        return execute(model_input)

    engine.executor.execute = record
    return inputs


@pytest.fixture(scope="module")
def alone(model) -> list[list[int]]:
    """Tokens of each prompt run by itself (seeded sampling)."""
    return [
        _engine(model).generate([p], s)[0].token_ids for p, s in zip(PROMPTS, SEEDED, strict=True)
    ]


def test_requests_alone_encode_once_then_decode(model, alone):
    engine = _engine(model)
    inputs = _recorded(engine)
    output = engine.generate([PROMPTS[1]], SEEDED[1])[0]
    assert output.token_ids == alone[1] and len(output.token_ids) == 10
    assert output.prompt_token_ids == PROMPTS[1]
    first, *later = inputs
    assert first.encoder_input_ids.tolist() == PROMPTS[1]
    assert first.input_ids.tolist() == [START]
    assert all(i.encoder_input_ids.numel() == 0 for i in later)
    assert all(i.metadata.encoder_seq_lens.tolist() == [len(PROMPTS[1])] for i in later)
    assert engine.stats.num_encoder_tokens_computed == len(PROMPTS[1])
    _assert_all_blocks_free(engine)


def test_continuous_batching_mixes_encoding_with_decodes(model, alone):
    # Two running sequences at most and a small step budget: each later request is encoded
    # in a step that also decodes the others.
    engine = _engine(model, max_num_seqs=2, max_num_batched_tokens=24)
    inputs = _recorded(engine)
    outputs = engine.generate(PROMPTS, SEEDED)
    assert [o.token_ids for o in outputs] == alone
    assert engine.stats.num_encoder_tokens_computed == sum(map(len, PROMPTS))
    mixed = [
        i
        for i in inputs
        if i.encoder_input_ids.numel() and (i.metadata.encoder_start_loc.diff() == 0).any()
    ]
    assert mixed, "no step encoded a request while decoding another"
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_keeps_tokens_and_recompute_reruns_the_encoder(model, alone, mode):
    # 8 blocks of 4 tokens: five requests of 11 decoder tokens need 15 at the end.
    engine = _engine(model, num_blocks=8, preemption_mode=mode, max_model_len=32)
    outputs = engine.generate(PROMPTS, SEEDED)
    assert [o.token_ids for o in outputs] == alone
    assert engine.stats.num_preemptions > 0
    encoded = engine.stats.num_encoder_tokens_computed
    if mode == "recompute":
        assert encoded > sum(map(len, PROMPTS))
    else:
        assert encoded == sum(map(len, PROMPTS))  # swapped requests kept their cross blocks
        assert engine.stats.num_swapped_in_blocks > 0
    _assert_all_blocks_free(engine)


def test_samples_share_the_cross_blocks_and_do_not_depend_on_the_batch(model):
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=3)
    reference = _engine(model).generate([PROMPTS[0]], sampled)[0]
    engine = _engine(model, max_num_batched_tokens=30)
    outputs = engine.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, sampled])
    assert outputs[0].error is None
    assert [c.token_ids for c in outputs[1].outputs] == [c.token_ids for c in reference.outputs]
    assert len({tuple(c.token_ids) for c in reference.outputs}) > 1
    assert engine.stats.num_encoder_tokens_computed == len(PROMPTS[1]) + len(PROMPTS[0])
    _assert_all_blocks_free(engine)


def test_forced_bos_and_eos(model, alone):
    engine = _engine(model)
    forced = SamplingParams(max_tokens=10, forced_bos_token_id=11, forced_eos_token_id=12)
    output = engine.generate([PROMPTS[0]], forced)[0]
    assert output.token_ids[0] == 11 and output.token_ids[-1] == 12
    assert len(output.token_ids) == 10 and output.finish_reason == "length"
    one = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=1, forced_bos_token_id=11))
    assert one[0].token_ids == [11]
    both = SamplingParams(max_tokens=1, forced_bos_token_id=11, forced_eos_token_id=12)
    assert engine.generate([PROMPTS[0]], both)[0].token_ids == [12]  # EOS wins
    short = _engine(model, max_model_len=4)  # the start token and 3 generated tokens
    params = dataclasses.replace(SEEDED[2], forced_eos_token_id=12)
    output = short.generate([PROMPTS[2]], params)[0]
    assert output.token_ids == [*alone[2][:2], 12]


def test_prefix_cache_keys_depend_on_the_encoder_input(model):
    engine = _engine(model)
    bm = engine.block_manager
    keys = []
    for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[0]):
        request = Request("r", [START], GREEDY, 0, encoder=EncoderInput(list(prompt)))
        seq = SequenceState(0, request, [START, 4, 4, 4, 4, 4], 0, None)
        keys.append(bm._key(seq, 0))
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_encoder_decoder_requests_are_checked(model):
    engine = _engine(model, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="encoder input is not chunked"):
        engine.add_request(list(range(8)))
    with pytest.raises(ValueError, match="forced_bos_token_id: token id 120 is outside"):
        engine.add_request([1], SamplingParams(forced_bos_token_id=120))
    with pytest.raises(ValueError, match="decoder_start_token_id 300 is outside"):
        Engine(TorchExecutor(model), encoder_decoder=EncoderDecoderConfig(300))
    with pytest.raises(ValueError, match="expected a token id"):
        EncoderDecoderConfig(-1)
    # Without a config the engine takes the start token the model states.
    assert Engine(TorchExecutor(model)).encoder_decoder.decoder_start_token_id == 2
    untold = BartForConditionalGeneration(BartConfig.tiny())
    executor = TorchExecutor(untold)
    executor.decoder_start_token_id = None
    with pytest.raises(ValueError, match="encoder_decoder: the model is an encoder-decoder"):
        Engine(executor)
