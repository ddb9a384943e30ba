"""The sampler: greedy, temperature, top-k, top-p, per-request seeded streams, temperatures
below the epsilon, and logits that are not finite."""

from __future__ import annotations

import pytest
import torch

from attnexport.runtime.sampling import (
    SAMPLING_EPS,
    NonFiniteLogitsError,
    SamplingParams,
    make_generator,
    sample,
)


def _logits(rows: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax_with_first_index_on_ties():
    logits = _logits()
    logits[1] = 0.0
    tokens = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert tokens == [int(logits[0].argmax()), 0, int(logits[2].argmax())]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_greedy_takes_any_float_dtype(dtype):
    logits = _logits().to(dtype)
    logits[2, 7] = logits[2].max()  # a tie after rounding: the first index wins
    expected = [int(torch.argmax(row.float())) for row in logits]
    assert sample(logits, [SamplingParams()] * 3, [None] * 3) == expected


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch():
    logits = _logits(rows=4)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)

    def draw(rows):
        generator = make_generator(params, 0)
        return [sample(logits[r : r + 1], [params], [generator])[0] for r in rows]

    alone = draw([2, 2, 2, 2, 2])
    assert alone == draw([2, 2, 2, 2, 2])
    # The same request in a batch next to a greedy and an unseeded one draws the same tokens.
    mixed = []
    generator = make_generator(params, 0)
    for _ in range(5):
        others = [SamplingParams(), SamplingParams(temperature=1.0)]
        batch_params = [others[0], params, others[1]]
        generators = [None, generator, make_generator(others[1], 0)]
        mixed.append(sample(logits[[0, 2, 3]], batch_params, generators)[1])
    assert mixed == alone
    # Different seeds (and different sample indices) give different streams.
    other = make_generator(SamplingParams(temperature=0.8, seed=8), 0)
    second = make_generator(params, 1)
    assert other.random(4).tolist() != second.random(4).tolist()


def test_top_k_and_top_p_restrict_the_candidates():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0]])
    for params, allowed in (
        (SamplingParams(temperature=1.0, top_k=1, seed=0), {1}),
        (SamplingParams(temperature=1.0, top_k=2, seed=0), {1, 2}),
        (SamplingParams(temperature=1.0, top_p=0.5, seed=0), {1}),
        (SamplingParams(temperature=100.0, seed=0), {0, 1, 2, 3, 4}),
    ):
        generator = make_generator(params, 0)
        seen = {sample(logits, [params], [generator])[0] for _ in range(200)}
        assert seen == allowed, params


@pytest.mark.parametrize(
    "changes,error,message",
    [
        ({"max_tokens": 0}, ValueError, "max_tokens: expected an int >= 1, got 0"),
        ({"max_tokens": 2.0}, TypeError, "max_tokens: expected an int"),
        ({"n": 0}, ValueError, "n: expected an int >= 1"),
        ({"temperature": -0.5}, ValueError, "temperature: expected a finite value >= 0"),
        ({"top_p": 0.0}, ValueError, r"top_p: expected a value in \(0, 1\]"),
        ({"top_k": -2}, ValueError, "top_k: expected an int >= -1"),
        ({"stop_token_ids": [3, -1]}, ValueError, "stop_token_ids: expected an int >= 0"),
        ({"forced_bos_token_id": -1}, ValueError, "forced_bos_token_id: expected an int >= 0"),
        ({"forced_eos_token_id": "2"}, TypeError, "forced_eos_token_id: expected an int"),
        # NumPy's SeedSequence refuses it later, with a message naming no field
        ({"seed": -1}, ValueError, "seed: expected an int >= 0, got -1"),
    ],
)
def test_bad_params_name_the_field(changes, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**changes).check()


def test_forced_tokens_first_and_last_eos_wins():
    params = SamplingParams(forced_bos_token_id=5, forced_eos_token_id=9)
    assert params.forced_token(0, is_last=False) == 5
    assert params.forced_token(3, is_last=False) is None
    assert params.forced_token(3, is_last=True) == 9
    assert params.forced_token(0, is_last=True) == 9
    assert SamplingParams().forced_token(0, is_last=True) is None


@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300, 1e-6])
@pytest.mark.parametrize("top_p", [0.9, 1.0])
def test_a_temperature_below_the_epsilon_is_greedy(temperature, top_p):
    """logits / 1e-310 overflowed to inf: with top_p < 1 the CDF was empty (IndexError, which
    failed the whole engine step), with top_p 1 every token had the same weight and the draw
    returned an arbitrary, usually unlikely, token."""
    logits = _logits(rows=4, vocab=200) * 10
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=3)
    assert params.greedy and make_generator(params, 0) is None
    assert sample(logits, [params] * 4, [None] * 4) == logits.argmax(dim=-1).tolist()


def test_the_smallest_sampled_temperature_cannot_overflow():
    """Logits at float32's limits divided by a temperature just above the epsilon: the
    shift by the maximum keeps every value finite, so the draw is the top token."""
    logits = torch.tensor([[-3e38, 3e38, 3.3e38, 0.0, float("-inf")]])
    params = SamplingParams(temperature=SAMPLING_EPS, top_p=0.9, seed=0)
    assert not params.greedy
    generator = make_generator(params, 0)
    assert {sample(logits, [params], [generator])[0] for _ in range(20)} == {2}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, seed=1)])
def test_a_non_finite_row_raises_for_greedy_and_random_sampling(bad, params):
    logits = _logits(rows=1)
    logits[0, 9] = bad
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        sample(logits, [params], [make_generator(params, 0)])
    everything_impossible = torch.full((1, 50), float("-inf"))
    with pytest.raises(NonFiniteLogitsError, match="its maximum is -inf"):
        sample(everything_impossible, [params], [make_generator(params, 0)])
