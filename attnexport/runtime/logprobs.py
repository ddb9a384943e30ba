"""Log-probabilities of tokens, from the logits the engine already has.

They are the model's own distribution: ``log_softmax`` of the raw logits row in float32,
before any penalty, bias, grammar mask or temperature (vLLM's default ``raw_logprobs``), so a
prompt's scores are what a perplexity evaluation needs and a sampled token's score does not
depend on how it was sampled. Every function works row by row (a row's result never depends on
the other rows of its batch): a request scores the same alone or batched.

An entry is :class:`TokenLogprobs`: the token's log-probability and rank, and the ``k`` most
likely tokens of its row (OpenAI's ``top_logprobs``, vLLM's ``logprobs=k``; the token itself is
returned beside them, so up to ``k + 1`` tokens are named, as both do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MAX_LOGPROBS = 20
"""Top log-probabilities per token a request may ask for (OpenAI's limit)."""

_BLOCK_ROWS = 64
"""Rows scored at once: bounds the float32 temporaries of a long prompt chunk."""


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The log-probability of one token of a sequence, and its row's most likely tokens."""

    token_id: int
    logprob: float
    """``log_softmax(logits)[token_id]``, float32 computed (as a Python float)."""
    rank: int
    """1 for the most likely token of the row: 1 + the tokens with a larger log-probability."""
    top_ids: tuple[int, ...] = ()
    """The row's ``k`` most likely tokens, most likely first."""
    top_logprobs: tuple[float, ...] = ()


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """``log_softmax`` of each row of ``rows`` ``[R, vocab]`` (float32, any float dtype in),
    computed in float32 as ``x - max - log(sum(exp(x - max)))`` per row. A row whose maximum
    is not finite gives NaNs (the sampler refuses such a row)."""
    rows = np.asarray(rows, dtype=np.float32)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    total = np.exp(shifted).sum(axis=-1, keepdims=True, dtype=np.float32)
    shifted -= np.log(total)
    return shifted


def token_logprobs(logprob_row: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """The entry of ``token`` in one ``log_softmax`` row ``[vocab]``, with its ``k`` most
    likely tokens."""
    value = logprob_row[token]
    rank = int(np.count_nonzero(logprob_row > value)) + 1
    top_ids, top_values = _top_k(logprob_row[None], k)
    return TokenLogprobs(
        int(token), float(value), rank, tuple(top_ids[0].tolist()), tuple(top_values[0].tolist())
    )


def score_rows(logits: np.ndarray, tokens: Sequence[int], k: int) -> list[TokenLogprobs]:
    """The entry of ``tokens[i]`` in row i of ``logits`` ``[R, vocab]`` (raw logits): a
    prompt's scores, ``tokens`` being the tokens that follow the rows' positions. Rows are
    scored in blocks, each row alone in effect (the same values as :func:`token_logprobs` of
    its :func:`log_softmax`)."""
    entries: list[TokenLogprobs] = []
    for start in range(0, len(tokens), _BLOCK_ROWS):
        block = log_softmax(logits[start : start + _BLOCK_ROWS])
        ids = np.asarray(tokens[start : start + _BLOCK_ROWS], dtype=np.int64)
        values = block[np.arange(len(ids)), ids]
        ranks = np.count_nonzero(block > values[:, None], axis=-1) + 1
        top_ids, top_values = _top_k(block, k)
        for i, token in enumerate(ids.tolist()):
            entries.append(
                TokenLogprobs(
                    token,
                    float(values[i]),
                    int(ranks[i]),
                    tuple(top_ids[i].tolist()),
                    tuple(top_values[i].tolist()),
                )
            )
    return entries


def _top_k(rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest values of each row and their ids, largest first, ties by lower id."""
    if k <= 0:
        empty = np.empty((rows.shape[0], 0))
        return empty.astype(np.int64), empty.astype(np.float32)
    k = min(k, rows.shape[-1])
    candidates = np.argpartition(-rows, k - 1, axis=-1)[:, :k]
    values = np.take_along_axis(rows, candidates, axis=-1)
    # Descending by value, then ascending by id (lexsort's last key is the primary one).
    order = np.lexsort((candidates, -values), axis=-1)
    ids = np.take_along_axis(candidates, order, axis=-1)
    return ids, np.take_along_axis(values, order, axis=-1)
