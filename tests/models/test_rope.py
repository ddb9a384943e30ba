"""RoPE tables: LongRoPE's frequencies and attention factor as transformers computes them,
the short/long choice per sequence of a packed step, and the per-token sequence lengths that
choice reads."""

from __future__ import annotations

import torch
import transformers
from hypothesis import given
from hypothesis import strategies as st
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from attnexport.models.phi3 import Phi3Config
from attnexport.models.rope import RotaryEmbedding, token_seq_lens

_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 300.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.5, 3.0, 7.0],
    "long_factor": [2.0, 5.0, 11.0, 13.0],
}


def _configs():
    sizes = dict(vocab_size=32, hidden_size=64, intermediate_size=32, num_hidden_layers=1)
    hf = transformers.Phi3Config(
        **sizes,
        num_attention_heads=4,
        max_position_embeddings=1000,
        original_max_position_embeddings=10,
        rope_parameters=dict(_ROPE),
    )
    return hf, Phi3Config.from_hf(hf.to_dict())


def test_longrope_frequencies_and_factor_are_transformers():
    hf, ours = _configs()
    longrope = ROPE_INIT_FUNCTIONS["longrope"]
    short, factor = longrope(hf, "cpu")
    long, _ = longrope(hf, "cpu", seq_len=11)
    assert ours.rope.attention_factor == factor > 1.0
    assert torch.equal(ours.rope.inv_freq(16), short)
    assert torch.equal(ours.rope.inv_freq(16, long=True), long)
    assert not torch.equal(short, long)


def test_each_sequence_takes_the_factors_of_its_own_length():
    """Sequences of 10 (short factors) and 11 tokens (long ones) in one step: each token's
    tables are those of its sequence's length, scaled by the attention factor."""
    _, ours = _configs()
    rope = RotaryEmbedding(16, ours.rope)
    positions = torch.tensor([8, 9, 9, 10])
    seq_lens = torch.tensor([10, 10, 11, 11])
    cos, sin = rope(positions, torch.float32, seq_lens)
    assert cos.shape == (4, 8)
    for row, (position, long) in enumerate(((8, False), (9, False), (9, True), (10, True))):
        freqs = position * ours.rope.inv_freq(16, long=long)
        emb = torch.cat((freqs, freqs))
        torch.testing.assert_close(cos[row], emb.cos() * ours.rope.attention_factor)
        torch.testing.assert_close(sin[row], emb.sin() * ours.rope.attention_factor)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=8).filter(lambda n: sum(n) > 0))
def test_token_seq_lens_is_the_seq_len_of_each_tokens_sequence(num_new):
    """Any step layout, sequences with no new token included."""
    lengths = torch.tensor(num_new)
    seq_lens = lengths + torch.arange(len(num_new)) * 7 + 1
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), lengths.cumsum(0))).int()
    positions = torch.zeros(int(lengths.sum()), dtype=torch.int64)
    expected = seq_lens.repeat_interleave(lengths)
    assert torch.equal(token_seq_lens(positions, seq_lens, query_start_loc), expected)
