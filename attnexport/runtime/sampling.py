"""Sampling parameters and the sampler.

Every sequence that samples at random owns a ``torch.Generator`` seeded from its request's
``seed`` and its sample index, and draws exactly one number per generated token. A seeded
request therefore produces the same tokens whatever else is in the batch, however it was
scheduled (chunked, preempted, recomputed), and on every executor that computes the same logits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from attnexport.errors import UserError, UserTypeError


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
    """0 means greedy (argmax); otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens; 0 or -1 disables."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose probabilities sum to top_p (nucleus)."""
    seed: int | None = None
    """Makes random sampling reproducible; None draws a fresh seed."""
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
            _check_int("seed", self.seed, minimum=None)
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, minimum=0)
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=0)

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


def _check_int(name: str, value, minimum: int | None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserTypeError(f"{name}: expected an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise UserError(f"{name}: expected an int >= {minimum}, got {value}")


def make_generator(params: SamplingParams, sample_index: int) -> torch.Generator | None:
    """The random stream of sample ``sample_index`` of a request; None for greedy requests."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
    # Distinct (seed, index) pairs get unrelated streams: sample 1 of seed s is not seed s + 1.
    return torch.Generator().manual_seed(hash((seed, sample_index)) & (2**63 - 1))


def sample(
    logits: torch.Tensor | np.ndarray,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits``.

    Args:
        logits: ``[N, vocab]`` floats on the CPU (a tensor, or a NumPy array as the engine
            passes them).
        params: N sampling parameters (row i uses ``params[i]``).
        generators: N generators; None for greedy rows.

    Returns:
        N token ids.
    """
    if not params:
        return []
    tokens = _argmax(logits)  # the greedy rows' tokens; the others are drawn below
    for i, p in enumerate(params):
        if not p.greedy:
            row = logits[i]
            row = torch.tensor(row) if isinstance(row, np.ndarray) else row
            tokens[i] = _sample_row(row, p, generators[i])
    return tokens


def _argmax(logits: torch.Tensor | np.ndarray) -> list[int]:
    """The first maximum (or NaN) of each row of ``[N, vocab]`` logits."""
    # NumPy's argmax runs on the calling thread. torch's would wake its OpenMP pool, whose
    # threads then spin on the cores an onnxruntime session is about to use (docs/benchmarks.md,
    # "Measured design choices").
    if isinstance(logits, torch.Tensor):
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # NumPy has no bfloat16; the float32 values keep the order
        logits = logits.detach().numpy()
    return logits.argmax(axis=-1).tolist()


def _sample_row(logits: torch.Tensor, params: SamplingParams, generator) -> int:
    """Inverse-CDF sampling over the tokens sorted by probability (one uniform per token)."""
    values, ids = torch.sort(logits.to(torch.float64) / params.temperature, descending=True)
    if 0 < params.top_k < values.numel():
        values, ids = values[: params.top_k], ids[: params.top_k]
    probs = torch.softmax(values, dim=0)
    if params.top_p < 1.0:
        # Keep the shortest prefix whose mass reaches top_p (the first token always stays).
        keep = int(((probs.cumsum(0) - probs) < params.top_p).sum())
        probs = probs[:keep]
    cdf = probs.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64) * cdf[-1]
    index = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
    return int(ids[index])
