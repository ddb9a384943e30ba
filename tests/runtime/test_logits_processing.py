"""Penalties, logit bias and min_tokens against a dense reference of vLLM's definitions, and a
row processed alone or in a batch comes out the same."""

from __future__ import annotations

import numpy as np
import pytest

from attnexport.runtime.logits_processing import RequestLogits, process_logits
from attnexport.runtime.sampling import SamplingParams

VOCAB = 512


def vllm_reference(logits, prompts, outputs, params) -> np.ndarray:
    """vLLM's sampler on dense float32 rows, as its source reads: logit_bias, min_tokens,
    then ``apply_penalties`` (repetition over prompt | output, frequency and presence over
    the output's bin counts)."""
    logits = logits.copy()
    vocab = logits.shape[1]
    for i, (prompt, output, p) in enumerate(zip(prompts, outputs, params, strict=True)):
        row = logits[i]
        for token, bias in (p.logit_bias or {}).items():
            row[token] += np.float32(bias)
        if len(output) < p.min_tokens:
            row[list(p.stop_token_ids)] = -np.inf
        prompt_mask = np.bincount(prompt, minlength=vocab) > 0
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)
        output_mask = counts > 0
        repetition = np.full(vocab, p.repetition_penalty, np.float32)
        repetition[~(prompt_mask | output_mask)] = 1.0
        row[:] = np.where(row > 0, row / repetition, row * repetition)
        row -= np.float32(p.frequency_penalty) * counts.astype(np.float32)
        row -= np.float32(p.presence_penalty) * output_mask.astype(np.float32)
    return logits


def _case(seed: int):
    rng = np.random.default_rng(seed)
    params = [
        SamplingParams(max_tokens=40, repetition_penalty=1.3),
        SamplingParams(max_tokens=40, frequency_penalty=0.7, presence_penalty=-0.4),
        SamplingParams(
            max_tokens=40,
            repetition_penalty=0.8,
            frequency_penalty=-1.1,
            presence_penalty=1.5,
            logit_bias={3: 100.0, 9: -100.0, 200: 2.5},
        ),
        SamplingParams(max_tokens=40, min_tokens=5, stop_token_ids=(1, 7), logit_bias={1: 5.0}),
    ]
    prompts = [rng.integers(0, VOCAB, size=int(rng.integers(1, 60))) for _ in params]
    outputs = [rng.integers(0, 60, size=int(rng.integers(0, 30))).tolist() for _ in params]
    logits = (rng.standard_normal((len(params), VOCAB)) * 4).astype(np.float32)
    samples = []
    for p, prompt, output in zip(params, prompts, outputs, strict=True):
        sample = RequestLogits(p, prompt.tolist(), VOCAB).new_sample()
        for token in output:
            sample.append(token)
        samples.append(sample)
    return params, prompts, outputs, logits, samples


@pytest.mark.parametrize("seed", range(4))
def test_penalties_equal_vllms_definitions(seed):
    params, prompts, outputs, logits, samples = _case(seed)
    expected = vllm_reference(logits, prompts, outputs, params)
    got = logits.copy()
    assert process_logits(got, list(range(len(params))), samples) == {}
    np.testing.assert_array_equal(got, expected)


def test_min_tokens_bans_the_stop_tokens_until_reached():
    params = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(4, 5))
    sample = RequestLogits(params, [1, 2], VOCAB).new_sample()
    for step in range(3):
        logits = np.zeros((1, VOCAB), np.float32)
        process_logits(logits, [0], [sample])
        banned = np.isneginf(logits[0, [4, 5]]).all()
        assert banned == (step < 2)
        assert np.isfinite(np.delete(logits[0], [4, 5])).all()
        sample.append(11)


def test_a_row_is_processed_the_same_alone_or_in_a_batch():
    *_, logits, samples = _case(7)
    batched = logits.copy()
    # Rows in another order, next to unprocessed rows.
    padded = np.concatenate([logits, logits[:1] * 3]).copy()
    process_logits(padded, [3, 0, 2, 1], [samples[3], samples[0], samples[2], samples[1]])
    process_logits(batched, list(range(4)), samples)
    for i in range(4):
        alone = logits[i : i + 1].copy()
        process_logits(alone, [0], [samples[i]])
        np.testing.assert_array_equal(alone[0], batched[i])
        np.testing.assert_array_equal(padded[i], batched[i])
    np.testing.assert_array_equal(padded[4], logits[0] * 3)


@pytest.mark.parametrize(
    "field, value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("min_tokens", 17),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
    ],
)
def test_bad_values_are_named(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=16, **{field: value}).check()
