"""Requests and their sequences: the state the scheduler and the block manager share.

A request with ``n`` samples starts as one sequence that prefills the prompt; when the prompt's
last token is computed the engine samples ``n`` tokens and forks the sequence, the forks sharing
every prompt block (copy-on-write).

An encoder-decoder request also carries its :class:`EncoderInput`: the user's prompt goes to
the encoder, the sequences start from the decoder start token, and the request's samples share
one set of cross-attention blocks, written once by the step that runs the encoder.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from attnexport.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from attnexport.runtime.logits_processing import RequestLogits, SampleLogits
    from attnexport.runtime.logprobs import TokenLogprobs


class Status(enum.Enum):
    WAITING = "waiting"
    """Not admitted yet, or preempted by recomputation (its blocks were freed)."""
    RUNNING = "running"
    SWAPPED = "swapped"
    """Preempted by swapping: its blocks live in the CPU pool."""
    FINISHED = "finished"


@dataclass(eq=False)
class EncoderInput:
    """The encoder side of an encoder-decoder request."""

    token_ids: list[int]
    """The prompt: the encoder runs on it (positions ``0 .. len - 1``)."""
    block_ids: list[int] = field(default_factory=list)
    """Blocks of the cross-attention pool holding the encoder keys/values (empty while the
    request is not admitted, or after a preemption by recomputation)."""
    encoded: bool = False
    """The encoder has written ``block_ids``; False again when they are freed."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(eq=False)
class SequenceState:
    """One sample of a request: its tokens, how many are in the cache, and its blocks."""

    seq_id: int
    request: Request
    token_ids: list[int]
    """Prompt followed by the generated tokens."""
    sample_index: int
    generator: np.random.Generator | None
    num_computed: int = 0
    """Leading tokens whose keys/values are in the cache."""
    block_ids: list[int] = field(default_factory=list)
    """Blocks holding the sequence, in order (device pool ids, or CPU pool ids when swapped)."""
    block_hashes: list[tuple] = field(default_factory=list)
    """Prefix-cache keys of the sequence's leading full blocks (computed lazily, in order)."""
    num_registered_blocks: int = 0
    """Leading blocks already entered in the prefix cache."""
    long_rope: bool = False
    """LongRoPE models: the cached keys were computed past the RoPE switch length (with the
    long factors); reset when the blocks are freed."""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    """One entry per generated token when the request asks for ``logprobs``."""
    logits_state: SampleLogits | None = None
    """Output counts and grammar position, when the request's parameters change its logits."""

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.request.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """A prompt and its sampling parameters, with per-request timings."""

    request_id: str
    prompt: list[int]
    """The tokens every sequence starts with: the prompt of a decoder, the decoder start token
    of an encoder-decoder (whose prompt is ``encoder.token_ids``)."""
    params: SamplingParams
    arrival_index: int
    """Admission order: older requests have smaller indices (FCFS, preempt the youngest)."""
    seqs: list[SequenceState] = field(default_factory=list)
    status: Status = Status.WAITING
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose prefill was skipped thanks to the prefix cache (first admission)."""
    num_preemptions: int = 0
    shared_prefix_len: int = 0
    """Set when forked samples are preempted by recomputation: the first unfinished sample
    recomputes these leading prompt tokens (whole blocks) alone, then the others share its
    blocks instead of computing them again."""
    error: str | None = None
    error_is_internal: bool = False
    """The error is the engine's (its executor failed), not the request's."""
    encoder: EncoderInput | None = None
    """Encoder-decoder requests only."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``params.prompt_logprobs``: the entries of the prompt tokens computed so far
    (the first is None: nothing predicts it)."""
    logits_plan: RequestLogits | None = None
    """What its parameters do to its logits (None when they change nothing)."""

    @property
    def scores_prompt(self) -> bool:
        """It asks for prompt log-probabilities that are not all computed yet (its prompt
        rows are then returned by the model, and it takes no prefix-cache hit)."""
        scores = self.prompt_logprobs
        return scores is not None and len(scores) < len(self.prompt)

    @property
    def user_prompt(self) -> list[int]:
        """The prompt as the user gave it (the encoder input of an encoder-decoder)."""
        return self.encoder.token_ids if self.encoder is not None else self.prompt

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def unfinished_seqs(self) -> list[SequenceState]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.error is not None or all(s.finished for s in self.seqs)
