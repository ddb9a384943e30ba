"""Log-probabilities from logits rows: float32 log_softmax against torch's, ranks and top-k,
and a row scored alone or in a block gives the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnexport.runtime.logprobs import log_softmax, score_rows, token_logprobs
from attnexport.tolerances import tolerance


def _rows(count: int = 5, vocab: int = 3000, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((count, vocab)).astype(np.float32) * 8
    rows[1] += 1e4  # large logits: the shift by the maximum keeps them exact
    rows[2, 17] = 60.0  # one dominant token
    return rows


def test_log_softmax_matches_torch_in_float32():
    rows = _rows()
    expected = torch.log_softmax(torch.from_numpy(rows), dim=-1).numpy()
    got = log_softmax(rows)
    assert got.dtype == np.float32
    torch.testing.assert_close(
        torch.from_numpy(got), torch.from_numpy(expected), **tolerance(torch.float32)
    )
    assert np.allclose(np.exp(got.astype(np.float64)).sum(-1), 1.0, atol=1e-5)


def test_an_entry_names_its_rank_and_the_most_likely_tokens():
    row = log_softmax(_rows()[:1])[0]
    order = np.argsort(-row, kind="stable")
    token = int(order[3])
    entry = token_logprobs(row, token, k=5)
    assert entry.token_id == token and entry.rank == 4
    assert entry.logprob == float(row[token])
    assert list(entry.top_ids) == order[:5].tolist()
    assert list(entry.top_logprobs) == [float(row[i]) for i in order[:5]]
    assert token_logprobs(row, int(order[0]), k=0).top_ids == ()
    assert token_logprobs(row, int(order[0]), k=0).rank == 1


@pytest.mark.parametrize("k", [0, 1, 20])
def test_rows_score_the_same_alone_or_in_a_block(k):
    rows = _rows(count=70)  # more than one block of rows
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, rows.shape[1], size=70)]
    together = score_rows(rows, tokens, k)
    alone = [token_logprobs(log_softmax(rows[i : i + 1])[0], tokens[i], k) for i in range(70)]
    assert together == alone
    middle = score_rows(rows[30:33], tokens[30:33], k)
    assert middle == together[30:33]
