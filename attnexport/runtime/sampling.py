"""Sampling parameters and the sampler.

Every sequence that samples at random owns a NumPy ``Generator`` seeded from its request's
``seed`` and its sample index, and draws exactly one number per generated token. A seeded
request therefore produces the same tokens whatever else is in the batch, however it was
scheduled (chunked, preempted, recomputed), and on every executor that computes the same logits.

A temperature below :data:`SAMPLING_EPS` samples greedily, as vLLM's does: logits divided by
it overflow (1e-310 turns every logit into inf), and below it sampling is argmax but for logits
closer than ~1e-4. Logits are shifted by their maximum before the division, so no temperature
the sampler divides by can overflow. A row whose largest logit is not finite (NaN, +inf, or
every token -inf) raises :class:`NonFiniteLogitsError`: the model's output is broken for that
sequence, and no token drawn from it would mean anything.

The sampler works on NumPy logits and imports no torch (the serving core runs without it).
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from attnexport.errors import UserError, UserTypeError
from attnexport.runtime.logprobs import MAX_LOGPROBS
from attnexport.runtime.structured_output import StructuredOutput

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``)."""


class NonFiniteLogitsError(RuntimeError):
    """A sequence's logits row has no finite maximum (NaN, +inf, or all -inf): the model's
    output, not the request, is at fault."""


@dataclass(frozen=True)
class SamplingParams:
    """How a request is sampled. The defaults are greedy decoding of 16 tokens.

    Values are checked per request by :meth:`check` when the request reaches the engine, so a
    bad value fails that request only.
    """

    max_tokens: int = 16
    """Tokens generated per sample, at most (fewer when a stop token or the model's maximum
    length is reached)."""
    temperature: float = 0.0
    """0 (or anything below :data:`SAMPLING_EPS`, 1e-5) means greedy (argmax); otherwise
    logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to top_p (nucleus)."""
    seed: int | None = None
    """Makes random sampling reproducible (an int >= 0, as NumPy seeds); None draws a fresh
    seed."""
    stop_token_ids: Sequence[int] = field(default=())
    """Generation of a sample stops after it produces one of these (the token is kept)."""
    n: int = 1
    """Samples generated from the prompt; they share the prompt's KV blocks."""
    forced_bos_token_id: int | None = None
    """The first generated token of every sample is this token (transformers'
    ``ForcedBOSTokenLogitsProcessor``; mBART/BART checkpoints set it to the target language)."""
    forced_eos_token_id: int | None = None
    """The last token a sample can generate (its ``max_tokens``-th, or the one reaching the
    model's maximum length) is this token (transformers' ``ForcedEOSTokenLogitsProcessor``).
    It wins over ``forced_bos_token_id`` when both apply to the same token."""
    logprobs: int | None = None
    """Each generated token's log-probability and its row's ``logprobs`` most likely tokens
    (0: the token's only; at most 20); None: none. The model's distribution, before any
    penalty, bias, grammar or temperature (:mod:`attnexport.runtime.logprobs`)."""
    prompt_logprobs: int | None = None
    """The same for every prompt token but the first (which nothing predicts); None: none.
    The prompt is then computed, not served from the prefix cache."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the sample generated (vLLM, OpenAI)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the sample generated it."""
    repetition_penalty: float = 1.0
    """vLLM's: the logit of a token of the prompt or the output is divided by it when
    positive, multiplied when negative (1: off)."""
    logit_bias: Mapping[int, float] | None = None
    """Token id -> value added to its logit before sampling (-100 bans, +100 forces)."""
    min_tokens: int = 0
    """The stop tokens are banned until the sample has this many tokens (a grammar's end
    is not: a structured sample ends where its grammar does)."""
    structured: StructuredOutput | None = None
    """The grammar the sample's text must match (JSON schema, any JSON object, ...)."""

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Some parameter changes the logits before sampling (penalties, bias, min_tokens,
        a grammar): the sampler's slower path takes the request's rows."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.structured is not None
        )

    @functools.cached_property
    def plain(self) -> bool:
        """Nothing but sampling: no log-probabilities, nothing that changes the logits (the
        sampler's fast path)."""
        return self.logprobs is None and not self.processes_logits

    @property
    def greedy(self) -> bool:
        """Argmax decoding: a temperature below :data:`SAMPLING_EPS`."""
        return self.temperature < SAMPLING_EPS

    def check(self) -> None:
        """Raises ValueError (TypeError for a wrong type) naming the first bad field."""
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_int("n", self.n, minimum=1)
        _check_int("top_k", self.top_k, minimum=-1)
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise UserTypeError(f"temperature: expected a float, got {self.temperature!r}")
        if not 0.0 <= self.temperature < float("inf"):
            raise UserError(
                f"temperature: expected a finite value >= 0 (0 = greedy), got {self.temperature}"
            )
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise UserError(f"top_p: expected a value in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, minimum=0)
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0, maximum=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name), -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 1e30)
        if self.repetition_penalty == 0.0:
            raise UserError("repetition_penalty: expected a value > 0 (1 = off), got 0")
        for token, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token, minimum=0)
            _check_float(f"logit_bias[{token}]", bias, -100.0, 100.0)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=self.max_tokens)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise UserTypeError(
                    f"structured: expected a StructuredOutput, got {type(self.structured).__name__}"
                )
            self.structured.check()

    def forced_token(self, num_generated: int, is_last: bool) -> int | None:
        """The token a sample must generate next, if forced: ``forced_eos_token_id`` for its
        last token (``is_last``), ``forced_bos_token_id`` for its first (``num_generated`` 0);
        None when it samples freely. Forcing replaces the sampled token, so a seeded sample
        still draws one random number per token."""
        if is_last and self.forced_eos_token_id is not None:
            return self.forced_eos_token_id
        if num_generated == 0 and self.forced_bos_token_id is not None:
            return self.forced_bos_token_id
        return None


def _check_int(name: str, value, minimum: int | None, maximum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserTypeError(f"{name}: expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise UserError(f"{name}: expected an int >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise UserError(f"{name}: expected an int <= {maximum}, got {value}")


def _check_float(name: str, value, low: float, high: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise UserTypeError(f"{name}: expected a float, got {value!r}")
    if not (math.isfinite(value) and low <= value <= high):
        raise UserError(f"{name}: expected a finite value in [{low}, {high}], got {value}")


def make_generator(params: SamplingParams, sample_index: int) -> np.random.Generator | None:
    """The random stream of sample ``sample_index`` of a request; None for greedy requests."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
    # A SeedSequence of the pair: distinct (seed, index) pairs get unrelated streams (sample 1
    # of seed s is not sample 0 of seed s + 1).
    return np.random.default_rng((seed, sample_index))


def sample(
    logits: np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[np.random.Generator | None],
) -> list[int]:
    """One token per row of ``logits``.

    Args:
        logits: ``[N, vocab]`` floats on the host: a NumPy array, as executors return them (a
            CPU torch tensor is taken too, converted without this module importing torch).
        params: N sampling parameters (row i uses ``params[i]``).
        generators: N generators; None for greedy rows.

    Returns:
        N token ids.

    Raises:
        NonFiniteLogitsError: a row without a finite maximum (the engine calls
            :func:`sample_token` per row instead, to fail that row's request alone).
    """
    if not params:
        return []
    logits = host_logits(logits)
    argmax = greedy_tokens(logits)
    return [sample_token(logits, i, p, generators[i], argmax[i]) for i, p in enumerate(params)]


def greedy_tokens(logits: np.ndarray) -> list[int]:
    """The argmax of each row of ``logits`` ``[N, vocab]`` (the first maximum, or the first
    NaN: :func:`sample_token` refuses that row)."""
    return logits.argmax(axis=-1).tolist()


def sample_token(
    logits: np.ndarray,
    row: int,
    params: SamplingParams,
    generator: np.random.Generator | None,
    argmax: int,
) -> int:
    """The next token from row ``row`` of ``logits`` ``[N, vocab]``, whose argmax is
    ``argmax`` (from :func:`greedy_tokens`): that token for greedy params, else a draw from
    ``generator``.

    Raises:
        NonFiniteLogitsError: the row's maximum is NaN or infinite.
    """
    top = logits.item(row, argmax)  # (the cheapest read of one value: a step reads N)
    if not math.isfinite(top):
        raise NonFiniteLogitsError(
            f"logits: the model's output row for this sequence is not finite (its maximum is "
            f"{top}); no token can be sampled from it"
        )
    if params.greedy:
        return argmax
    return _sample_row(logits[row], top, params, generator)


def host_logits(logits) -> np.ndarray:
    """``logits`` as a float32/float64 NumPy array (a torch tensor is converted, a bfloat16 or
    float16 one to float32 first: the float32 values keep the order)."""
    if isinstance(logits, np.ndarray):
        return logits
    logits = logits.detach().cpu()
    if str(logits.dtype) not in ("torch.float32", "torch.float64"):
        logits = logits.float()  # NumPy has no bfloat16
    return logits.numpy()


def _sample_row(
    logits: np.ndarray, top: float, params: SamplingParams, generator: np.random.Generator
) -> int:
    """Inverse-CDF sampling over the tokens sorted by probability (one uniform per token);
    ``top`` is the row's finite maximum."""
    # Shifted first: every value is <= 0, so dividing by a temperature >= SAMPLING_EPS stays
    # finite (-inf logits stay -inf and get probability 0).
    scaled = logits.astype(np.float64)
    scaled -= top
    scaled /= params.temperature
    ids = np.argsort(-scaled, kind="stable")  # descending; ties keep the lower id first
    values = scaled[ids]
    if 0 < params.top_k < values.size:
        values, ids = values[: params.top_k], ids[: params.top_k]
    probs = np.exp(values)  # values[0] is 0: the top token has weight 1
    probs /= probs.sum()
    if params.top_p < 1.0:
        # Keep the shortest prefix whose mass reaches top_p (the first token always stays).
        keep = int(((np.cumsum(probs) - probs) < params.top_p).sum())
        probs = probs[:keep]
    cdf = np.cumsum(probs)
    u = generator.random() * cdf[-1]
    index = min(int(np.searchsorted(cdf, u, side="right")), cdf.size - 1)
    return int(ids[index])
