"""What a request's parameters do to its logits rows before sampling, with vLLM's definitions
and in vLLM's order: the grammar's mask, ``logit_bias``, ``min_tokens``, then the penalties
(``repetition_penalty`` over the prompt and output tokens, ``frequency_penalty`` and
``presence_penalty`` over the output tokens):

    logit += bias[token]                                  # logit_bias
    logit  = -inf  for stop tokens while outputs < min_tokens
    logit  = logit / rep if logit > 0 else logit * rep    # tokens of prompt or output
    logit -= frequency * count(token in output)
    logit -= presence  * (token in output)

All in the logits' float32, as vLLM computes them. Each sample keeps its output counts as a
vocabulary-sized int32 array updated as tokens are appended, and the distinct tokens it holds
in order; a step then touches only those tokens: one NumPy fancy-index operation per kind over
all the rows of the step (no Python loop over the vocabulary, no per-step bincount). The
grammar mask is filled per sample (llguidance) and applied to all its rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.structured_output import (
    CompiledGrammar,
    GrammarMatcher,
    apply_bitmasks,
    bitmask_for,
    fill_bitmasks,
)


class _IdList:
    """A growing int64 array (distinct token ids in first-seen order)."""

    __slots__ = ("_ids", "size")

    def __init__(self) -> None:
        self._ids = np.empty(16, dtype=np.int64)
        self.size = 0

    def append(self, token: int) -> None:
        if self.size == self._ids.size:
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
        self._ids[self.size] = token
        self.size += 1

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.size]


class RequestLogits:
    """What one request does to its rows, prepared once when it is admitted.

    Args:
        params: the request's sampling parameters (``processes_logits`` true).
        prompt: its prompt token ids (the repetition penalty's prompt tokens).
        vocab_size: the logits' width.
        grammar: its compiled grammar (``params.structured``), if any.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt: Sequence[int],
        vocab_size: int,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.grammar = grammar
        bias = params.logit_bias or {}
        self.bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self.bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self.min_tokens = params.min_tokens
        self.stop_ids = np.array(sorted(set(params.stop_token_ids)), dtype=np.int64)
        self.repetition = np.float32(params.repetition_penalty)
        self.frequency = np.float32(params.frequency_penalty)
        self.presence = np.float32(params.presence_penalty)
        self.counts_outputs = bool(params.frequency_penalty or params.presence_penalty)
        self.prompt_ids: np.ndarray | None = None
        self.in_prompt: np.ndarray | None = None
        if self.repetition != 1.0:
            self.prompt_ids = np.unique(np.asarray(prompt, dtype=np.int64))
            self.in_prompt = np.zeros(vocab_size, dtype=bool)
            self.in_prompt[self.prompt_ids] = True

    def new_sample(self) -> SampleLogits:
        """The state of a new sample of the request (nothing generated)."""
        return SampleLogits(self)


class SampleLogits:
    """One sample's output counts and grammar position."""

    __slots__ = ("counts", "matcher", "num_outputs", "output_ids", "repeated_ids", "request")

    def __init__(self, request: RequestLogits) -> None:
        self.request = request
        self.num_outputs = 0
        self.matcher: GrammarMatcher | None = (
            request.grammar.matcher() if request.grammar is not None else None
        )
        tracks = request.counts_outputs or request.prompt_ids is not None
        self.counts = np.zeros(request.vocab_size, dtype=np.int32) if tracks else None
        self.output_ids = _IdList()
        """Distinct generated tokens (frequency and presence penalties)."""
        self.repeated_ids = _IdList()
        """Distinct generated tokens not in the prompt (repetition penalty)."""

    def append(self, token: int) -> None:
        """The sample generated ``token``: counted, and taken by its grammar (RuntimeError
        when the grammar refuses it)."""
        self.num_outputs += 1
        counts = self.counts
        if counts is not None:
            if counts[token] == 0:
                self.output_ids.append(token)
                in_prompt = self.request.in_prompt
                if in_prompt is not None and not in_prompt[token]:
                    self.repeated_ids.append(token)
            counts[token] += 1
        if self.matcher is not None:
            self.matcher.accept(token)

    @property
    def grammar_finished(self) -> bool:
        return self.matcher is not None and self.matcher.is_finished


def process_logits(
    logits: np.ndarray, rows: Sequence[int], samples: Sequence[SampleLogits]
) -> dict[int, Exception]:
    """Applies, in place, what ``samples[i]`` does to row ``rows[i]`` of ``logits``
    ``[N, vocab]`` (float32; rows distinct). Returns the failures by index i (a grammar in an
    error state): their rows are left as they are and must not be sampled."""
    failed: dict[int, Exception] = {}
    grammar = [i for i, s in enumerate(samples) if s.matcher is not None]
    if grammar:
        _mask_grammar(logits, rows, samples, grammar, failed)
    bias = [i for i, s in enumerate(samples) if s.request.bias_ids.size and i not in failed]
    if bias:
        cols = [samples[i].request.bias_ids for i in bias]
        values = np.concatenate([samples[i].request.bias_values for i in bias])
        _add(logits, rows, bias, cols, values)
    banned = [
        i
        for i, s in enumerate(samples)
        if s.num_outputs < s.request.min_tokens and s.matcher is None and s.request.stop_ids.size
    ]
    if banned:
        r, c = _indices(rows, banned, [samples[i].request.stop_ids for i in banned])
        logits[r, c] = -np.inf
    repeated = [i for i, s in enumerate(samples) if s.request.prompt_ids is not None]
    if repeated:
        cols = [
            np.concatenate([samples[i].request.prompt_ids, samples[i].repeated_ids.ids])
            for i in repeated
        ]
        r, c = _indices(rows, repeated, cols)
        penalty = np.repeat([samples[i].request.repetition for i in repeated], _sizes(cols))
        values = logits[r, c]
        logits[r, c] = np.where(values > 0, values / penalty, values * penalty)
    counted = [i for i, s in enumerate(samples) if s.request.counts_outputs and s.num_outputs]
    if counted:
        cols = [samples[i].output_ids.ids for i in counted]
        r, c = _indices(rows, counted, cols)
        sizes = _sizes(cols)
        counts = np.concatenate(
            [samples[i].counts[col] for i, col in zip(counted, cols, strict=True)]
        )
        frequency = np.repeat([samples[i].request.frequency for i in counted], sizes)
        presence = np.repeat([samples[i].request.presence for i in counted], sizes)
        logits[r, c] -= frequency * counts.astype(np.float32)
        logits[r, c] -= presence
    return failed


def _mask_grammar(logits, rows, samples, grammar: list[int], failed: dict) -> None:
    bitmask = bitmask_for(len(grammar), logits.shape[-1])
    fill_bitmasks([samples[i].matcher for i in grammar], bitmask)
    kept = []
    for position, i in enumerate(grammar):
        error = samples[i].matcher.error
        if error is not None:
            failed[i] = RuntimeError(f"the grammar failed: {error}")
        else:
            kept.append(position)
    if not kept:
        return
    selected = [rows[grammar[k]] for k in kept]
    block = logits[selected]
    apply_bitmasks(block, bitmask[kept])
    logits[selected] = block


def _sizes(cols: list[np.ndarray]) -> np.ndarray:
    return np.fromiter((c.size for c in cols), dtype=np.int64, count=len(cols))


def _indices(rows, chosen: list[int], cols: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) index arrays of the columns ``cols[k]`` of row ``rows[chosen[k]]``."""
    r = np.repeat(np.asarray([rows[i] for i in chosen], dtype=np.int64), _sizes(cols))
    return r, np.concatenate(cols)


def _add(logits, rows, chosen: list[int], cols: list[np.ndarray], values: np.ndarray) -> None:
    r, c = _indices(rows, chosen, cols)
    logits[r, c] += values
