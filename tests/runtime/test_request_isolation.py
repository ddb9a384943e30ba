"""One request can never fail another: what goes wrong with one request inside a step (its
logits row is NaN, its text cannot be decoded) fails that request alone, and a per-request
limit (``max_model_len``) can never surface as a failure of the step its co-batched requests
are in."""

from __future__ import annotations

import pytest

from attnexport.errors import UserError
from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig, TorchExecutor
from attnexport.runtime.text import Tokenizer
from tests.runtime.echo_decoder import EchoDecoder, reference_tokens
from tests.runtime.poisoned import PoisonedRows
from tests.text_tokenizers import BUILDERS

MODEL = EchoDecoder(vocab_size=50, max_model_len=64)
VICTIMS = [[1, 2, 3, 4, 5], [7, 8]]
MAX_TOKENS = 10


class PoisonedEcho(PoisonedRows, TorchExecutor):
    def __init__(self, poison: int) -> None:
        super().__init__(MODEL, cache_spec=MODEL.cache_spec(2))
        self.poison = poison


def _engine(poison: int, **scheduler) -> Engine:
    scheduler.setdefault("max_model_len", 32)
    return Engine(
        PoisonedEcho(poison),
        CacheConfig(num_blocks=64, num_cpu_blocks=8),
        SchedulerConfig(**scheduler),
    )


def _solo(prompt: list[int], max_len: int = 32) -> list[int]:
    return reference_tokens(prompt, MAX_TOKENS, MODEL.vocab_size, max_len)


def _assert_released(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.device.num_free == engine.num_blocks and not any(bm.device.ref_counts)
    assert not engine.has_unfinished_requests()


def _fed_back(prompt: list[int]) -> set[int]:
    """The tokens whose logits rows a request's run asks for."""
    return {prompt[-1], *_solo(prompt)[:-1]}


BAD = [10, 12, 13]


@pytest.mark.parametrize(
    "when,params",
    [
        ("prefill", SamplingParams(MAX_TOKENS)),
        ("prefill", SamplingParams(MAX_TOKENS, n=2, temperature=0.5, seed=4)),
        ("decode", SamplingParams(MAX_TOKENS)),  # its third token's row
    ],
)
def test_a_nan_logits_row_fails_its_request_alone(when, params):
    """NaN logits were sampled as a token (greedy: the NaN's index) without a word; in a
    random sample they made an empty CDF whose IndexError failed every request of the step."""
    bad = BAD
    poison = bad[-1] if when == "prefill" else _solo(bad)[2]
    assert not any(poison in _fed_back(v) for v in VICTIMS)
    engine = _engine(poison)
    victim_params = SamplingParams(MAX_TOKENS)
    outputs = engine.generate([VICTIMS[0], bad, VICTIMS[1]], [victim_params, params, victim_params])
    assert [outputs[0].token_ids, outputs[2].token_ids] == [_solo(v) for v in VICTIMS]
    assert outputs[0].error is None and outputs[2].error is None
    failed = outputs[1]
    assert failed.finished and failed.finish_reason == "error" and failed.error_is_internal
    assert "NonFiniteLogitsError" in failed.error and "not finite" in failed.error
    expected = [] if when == "prefill" else _solo(bad)[:3]
    assert all(sample.token_ids == expected for sample in failed.outputs)
    _assert_released(engine)
    # The engine goes on, the poisoned request's blocks reused.
    assert engine.generate([VICTIMS[1]], victim_params)[0].token_ids == _solo(VICTIMS[1])


def test_a_failed_request_streams_its_error_and_the_others_their_tokens():
    bad = BAD
    engine = _engine(poison=bad[-1])
    finals = {}
    for update in engine.stream([VICTIMS[0], bad], SamplingParams(MAX_TOKENS)):
        if update.finished:
            finals[update.request_id] = update
    victim, failed = sorted(finals.values(), key=lambda o: o.prompt_token_ids != VICTIMS[0])
    assert victim.token_ids == _solo(VICTIMS[0]) and victim.error is None
    assert failed.finish_reason == "error" and "NonFiniteLogitsError" in failed.error
    _assert_released(engine)


class _RefusingTokenizer(Tokenizer):
    """Decoding any text holding the token ``refused`` raises (a tokenizer bug)."""

    def __init__(self, inner: Tokenizer, refused: int) -> None:
        super().__init__(inner.hf)
        self.refused = refused

    def decode(self, ids) -> str:
        if self.refused in ids:
            raise RuntimeError(f"cannot decode token {self.refused}")
        return super().decode(ids)


@pytest.mark.parametrize("api", ["generate", "stream"])
def test_text_that_cannot_be_decoded_fails_its_request_alone(api, tmp_path):
    refused = _solo(BAD)[0]
    assert not any(refused in _solo(v) for v in VICTIMS)
    tokenizer = _RefusingTokenizer(
        Tokenizer.from_directory(BUILDERS["byte_level_bpe"](tmp_path)), refused
    )
    engine = Engine(
        TorchExecutor(MODEL, cache_spec=MODEL.cache_spec(2)),
        CacheConfig(num_blocks=64),
        SchedulerConfig(max_model_len=32),
        tokenizer=tokenizer,
    )
    prompts, params = [VICTIMS[0], BAD, VICTIMS[1]], SamplingParams(MAX_TOKENS)
    if api == "generate":
        outputs = engine.generate(prompts, params)
    else:
        finals = {o.request_id: o for o in engine.stream(prompts, params) if o.finished}
        outputs = sorted(finals.values(), key=lambda o: prompts.index(o.prompt_token_ids))
    for victim, output in zip(VICTIMS, (outputs[0], outputs[2]), strict=True):
        assert output.error is None and output.token_ids == _solo(victim)
        assert output.text == tokenizer.decode(_solo(victim))
    failed = outputs[1]
    assert failed.finish_reason == "error" and failed.error_is_internal
    assert f"decoding the text failed: RuntimeError: cannot decode token {refused}" in failed.error
    _assert_released(engine)


def test_a_max_model_len_longer_than_the_models_is_refused():
    """The engine took a max_model_len above the executor's: a sequence crossing the model's
    positions made the executor refuse the step, failing every request batched with it."""
    with pytest.raises(UserError, match="max_model_len: 128 is longer than the model's maximum "):
        Engine(
            TorchExecutor(MODEL, cache_spec=MODEL.cache_spec(2)),
            CacheConfig(num_blocks=128),
            SchedulerConfig(max_model_len=128),
        )
    with pytest.raises(UserError, match=r"max_model_len: 65 .* \(EchoDecoder's config\)"):
        TorchExecutor(MODEL, cache_spec=MODEL.cache_spec(2), max_model_len=65)
    with pytest.raises(UserError, match="sequence lengths are int32"):
        SchedulerConfig(max_model_len=2**31)


def test_requests_reaching_max_model_len_end_alone():
    """A prompt longer than max_model_len is refused on admission, one that grows to it ends
    with "length"; the request batched with them completes."""
    engine = _engine(poison=-1, max_model_len=16)
    too_long, crossing = list(range(1, 18)), list(range(1, 13))
    outputs = engine.generate([VICTIMS[0], too_long, crossing], SamplingParams(MAX_TOKENS))
    assert outputs[0].token_ids == _solo(VICTIMS[0], max_len=16)
    assert outputs[1].finish_reason == "error" and not outputs[1].error_is_internal
    assert "prompt: 17 tokens is longer than the model's maximum length" in outputs[1].error
    assert outputs[2].finish_reason == "length" and len(outputs[2].token_ids) == 4
    _assert_released(engine)
