"""Checking one request against an engine's limits before it is queued."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from attnexport.errors import UserError, UserTypeError
from attnexport.runtime.config import SchedulerConfig
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.text import Tokenizer


@dataclass(frozen=True)
class RequestLimits:
    """What an engine can take: its model's vocabulary and length, its scheduler's limits."""

    vocab_size: int
    max_model_len: int
    scheduler_config: SchedulerConfig
    encoder_decoder: bool
    """The prompt is an encoder input (run whole, not chunked)."""
    rope_switch_length: int | None = None
    """LongRoPE: a sequence that gets longer than this is computed again over a first chunk
    of at least ``rope_switch_length + 1`` tokens (see :mod:`attnexport.runtime.scheduler`)."""

    def check(
        self, prompt: Sequence[int] | str, params: SamplingParams, tokenizer: Tokenizer | None
    ) -> list[int]:
        """Validates one request; returns the prompt as a list of ints (a text prompt encoded
        with ``tokenizer``).

        Raises:
            TypeError: a prompt that is not a sequence of ints, or params that are not
                SamplingParams.
            ValueError: an empty prompt, a prompt longer than ``max_model_len``, a token id
                (prompt, forced or stop) outside ``[0, vocab_size)``, bad sampling parameters, or
                (LongRoPE) a request that grows past the RoPE switch length when
                ``max_num_batched_tokens`` cannot hold the recomputation.
        """
        if not isinstance(params, SamplingParams):
            raise UserTypeError(f"params: expected SamplingParams, got {type(params).__name__}")
        params.check()
        tokens = _token_ids(prompt, tokenizer)
        if not tokens:
            raise UserError("prompt: expected at least one token, got an empty prompt")
        if len(tokens) > self.max_model_len:
            raise UserError(
                f"prompt: {len(tokens)} tokens is longer than the model's maximum length "
                f"(max_model_len={self.max_model_len})"
            )
        vocab = self.vocab_size
        bad = next((t for t in tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise UserError(
                f"prompt: token id {bad} is outside the vocabulary; expected ids in [0, {vocab})"
            )
        for name in ("forced_bos_token_id", "forced_eos_token_id"):
            forced = getattr(params, name)
            if forced is not None and forced >= vocab:
                raise UserError(
                    f"{name}: token id {forced} is outside the vocabulary; expected [0, {vocab})"
                )
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise UserError(
                f"logit_bias: token id {bad} is outside the vocabulary; expected ids in "
                f"[0, {vocab})"
            )
        if params.prompt_logprobs is not None and self.encoder_decoder:
            raise UserError(
                "prompt_logprobs: an encoder-decoder's prompt is its encoder input, which the "
                "decoder does not predict"
            )
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise UserError(
                f"stop_token_ids: token id {bad} is outside the vocabulary; expected ids in "
                f"[0, {vocab})"
            )
        self._check_scheduling(len(tokens), params)
        return tokens

    def _check_scheduling(self, num_tokens: int, params: SamplingParams) -> None:
        """The scheduler can run a prompt of ``num_tokens`` with ``params.n`` samples."""
        config = self.scheduler_config
        if params.n > config.max_num_seqs:
            raise UserError(f"n: {params.n} samples exceed max_num_seqs={config.max_num_seqs}")
        budget = config.max_num_batched_tokens
        if self.encoder_decoder and num_tokens + 1 > budget:
            raise UserError(
                f"prompt: {num_tokens} encoder tokens and the decoder's first token exceed "
                f"max_num_batched_tokens={budget} (the encoder input is not chunked)"
            )
        if not config.enable_chunked_prefill and num_tokens > budget:
            raise UserError(
                f"prompt: {num_tokens} tokens exceed max_num_batched_tokens={budget} and "
                "chunked prefill is disabled"
            )
        switch = self.rope_switch_length
        if switch is not None and budget <= switch:
            # The longest sequence a step computes: the prompt, or the one before the last
            # generated token (the last is sampled, never fed back).
            longest = max(num_tokens, min(num_tokens + params.max_tokens, self.max_model_len) - 1)
            if longest > switch:
                raise UserError(
                    f"max_num_batched_tokens: {budget} tokens cannot hold this request's "
                    f"recomputation past the model's RoPE switch length {switch} (LongRoPE "
                    f"original_max_position_embeddings; the prompt has {num_tokens} tokens, "
                    f"max_tokens={params.max_tokens}): use max_num_batched_tokens >= "
                    f"{switch + 1}, or fewer tokens"
                )


def _token_ids(prompt: Sequence[int] | str, tokenizer: Tokenizer | None) -> list[int]:
    """``prompt`` as a list of ints (text encoded with ``tokenizer``); raises TypeError for
    anything else."""
    if isinstance(prompt, str) and tokenizer is not None:
        prompt = tokenizer.encode(prompt)
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
        raise UserTypeError(
            f"prompt: expected a list of token ids, got {type(prompt).__name__} (text "
            "prompts need an engine with a tokenizer)"
        )
    tokens = []
    for token in prompt:
        if isinstance(token, bool) or not hasattr(token, "__index__"):
            raise UserTypeError(f"prompt: expected int token ids, got {token!r}")
        tokens.append(operator.index(token))
    return tokens
