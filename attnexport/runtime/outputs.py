"""What the engine returns for each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnexport.runtime.logprobs import TokenLogprobs
from attnexport.runtime.sequence import Request
from attnexport.runtime.text import IncrementalDetokenizer, Tokenizer

FINISH_REASONS = ("stop", "length", "error", "aborted")


@dataclass
class CompletionOutput:
    """One sample of a request."""

    index: int
    """Sample index in ``0 .. n-1``."""
    token_ids: list[int]
    """The generated tokens (a stop token that ended the sample is included)."""
    finish_reason: str | None
    """``"stop"`` (a stop token), ``"length"`` (max_tokens or the model's maximum length),
    ``"error"``, ``"aborted"``, or None while it is still generating."""
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens added since the previous output of this request (streaming)."""
    text: str | None = None
    """The generated text (``tokenizer.decode(token_ids, skip_special_tokens=True)``) when
    the engine has a tokenizer, else None. While streaming, the text streamed so far: it lags
    the tokens by a partial character or word until the sample finishes."""
    text_delta: str | None = None
    """Text added since the previous output of this request (streaming; all of ``text``
    otherwise): never a broken multi-byte character, and the deltas of a sample concatenate
    to its final ``text``."""
    logprobs: list[TokenLogprobs] | None = None
    """With ``SamplingParams.logprobs``: one entry per token of ``token_ids`` (those of
    ``new_token_ids`` are the last ones)."""


@dataclass
class RequestMetrics:
    """Timings in seconds on ``time.perf_counter``'s clock, and prefix-cache use."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    """Prompt tokens served from the prefix cache (not computed)."""
    num_preemptions: int
    """Times the request was evicted and requeued, its LongRoPE regime-switch recomputation
    included (``EngineStats`` counts those apart)."""

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        if self.finish_time is None:
            return None
        return self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request: its samples, whether it finished, and its error if it failed.

    A request that fails validation (or cannot ever fit the KV pool) has ``error`` set, no
    tokens, and finish reason ``"error"``; the other requests are not affected.
    """

    request_id: str
    prompt_token_ids: list[int]
    """The prompt as given (for an encoder-decoder, the encoder input; the decoder start token
    is in neither this nor the generated tokens)."""
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None
    metrics: RequestMetrics
    error_is_internal: bool = False
    """``error`` is the engine's (its executor failed, it stopped), not a fault of the request
    (e.g. larger than the KV pool): a server answers it with 500, not 400."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token (None for the
    first), once the prompt is computed (None before)."""

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens of sample 0."""
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def text(self) -> str | None:
        """The generated text of sample 0 (None without a tokenizer)."""
        return self.outputs[0].text if self.outputs else None

    @property
    def text_delta(self) -> str | None:
        """The text sample 0 added since the previous output (streaming)."""
        return self.outputs[0].text_delta if self.outputs else None

    @property
    def finish_reason(self) -> str | None:
        """The finish reason of sample 0 (``"error"`` for a failed request)."""
        if self.error is not None:
            return "error"
        return self.outputs[0].finish_reason if self.outputs else None


def snapshot(
    request: Request,
    sent: dict[int, int] | None = None,
    tokenizer: Tokenizer | None = None,
    texts: dict[int, IncrementalDetokenizer] | None = None,
) -> RequestOutput:
    """The output of ``request`` now; ``sent`` maps sample index to tokens already reported and
    is advanced (for streaming deltas). With a ``tokenizer`` the samples get their text: a full
    decode, or, given ``texts`` (sample index -> detokenizer, filled here), streamed deltas."""
    outputs = []
    for seq in request.seqs:
        tokens = seq.output_ids
        start = 0
        if sent is not None:
            start = sent.get(seq.sample_index, 0)
            sent[seq.sample_index] = len(tokens)
        reason = seq.finish_reason
        if request.error is not None:
            reason = "error"
        output = CompletionOutput(seq.sample_index, tokens, reason, tokens[start:])
        if seq.logprobs is not None:
            output.logprobs = seq.logprobs[:]
        if tokenizer is not None:
            _add_text(output, tokenizer, texts)
        outputs.append(output)
    outputs.sort(key=lambda o: o.index)
    scores = request.prompt_logprobs
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=list(request.user_prompt),
        outputs=outputs,
        finished=request.finished,
        error=request.error,
        error_is_internal=request.error_is_internal,
        prompt_logprobs=scores[:] if scores is not None and not request.scores_prompt else None,
        metrics=RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            num_prompt_tokens=len(request.user_prompt),
            num_cached_prompt_tokens=request.num_cached_prompt_tokens,
            num_preemptions=request.num_preemptions,
        ),
    )


def _add_text(
    output: CompletionOutput,
    tokenizer: Tokenizer,
    texts: dict[int, IncrementalDetokenizer] | None,
) -> None:
    if texts is None:
        output.text = output.text_delta = tokenizer.decode(output.token_ids)
        return
    detokenizer = texts.get(output.index)
    if detokenizer is None:
        detokenizer = texts[output.index] = tokenizer.detokenizer()
    delta = detokenizer.push(output.new_token_ids)
    if output.finish_reason is not None:
        delta += detokenizer.finish()
    output.text, output.text_delta = detokenizer.emitted, delta
