"""The engine: requests in, tokens out, one continuous-batching step at a time.

    engine = Engine(executor)                      # defaults sized for the machine
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    for update in engine.stream(prompts, params):  # one RequestOutput per request per step
        ...

An encoder-decoder executor (its cache spec has cross layers, e.g. BART) takes the same calls:
the prompt is the encoder input, every sample's decoder starts from
``EncoderDecoderConfig.decoder_start_token_id``, and outputs hold the generated tokens only
(neither the prompt nor the start token), like a decoder's.

``generate`` and ``stream`` never raise for one bad request: that request comes back with
``error`` set and finish reason ``"error"`` while the others run. ``add_request`` (the low-level
API, with ``step``) raises ValueError/TypeError for a bad request instead. What goes wrong with
one request after it was admitted (its logits row is NaN, its text cannot be decoded) fails
that request alone (``error`` set, ``error_is_internal`` True, its blocks freed) while the step
goes on. Only an exception from the executor (the model run, the block moves) fails a whole
step: it is raised on, after the requests of its step are finished with ``error`` set and
their blocks freed (``generate`` and ``stream`` abort their other requests as they unwind): the
engine stays usable.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from attnexport.errors import UserError
from attnexport.runtime.block_manager import BlockManager
from attnexport.runtime.config import (
    DEFAULT_MAX_MODEL_LEN,
    CacheConfig,
    EncoderDecoderConfig,
    SchedulerConfig,
    checked_max_model_len,
    resolve_num_blocks,
)
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.loading import encoder_decoder_config, load_executor
from attnexport.runtime.logits_processing import RequestLogits
from attnexport.runtime.model_input import ModelInput
from attnexport.runtime.output_processor import OutputProcessor
from attnexport.runtime.outputs import RequestOutput, snapshot
from attnexport.runtime.request_checks import RequestLimits
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.scheduler import ScheduledBatch, Scheduler
from attnexport.runtime.sequence import EncoderInput, Request, Status
from attnexport.runtime.step_packing import pack_decoder_batch, pack_encoder_decoder_batch
from attnexport.runtime.structured_output import GrammarCompiler
from attnexport.runtime.text import Tokenizer

logger = logging.getLogger("attnexport.runtime")


@dataclass
class EngineStats:
    """Counters since the engine was built (or :meth:`Engine.reset_stats`)."""

    num_steps: int = 0
    num_computed_tokens: int = 0
    """Tokens run through the model (prefill chunks, recomputation and decodes)."""
    num_prompt_tokens_computed: int = 0
    """Prompt tokens run through the model (not served by the prefix cache)."""
    num_prefix_cache_hit_tokens: int = 0
    num_encoder_tokens_computed: int = 0
    """Encoder-decoder models: encoder tokens run (again after a recomputation)."""
    num_preemptions: int = 0
    num_rope_recomputations: int = 0
    """LongRoPE models: requests recomputed because they grew past the RoPE switch length
    (not counted in ``num_preemptions``)."""
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_copied_blocks: int = 0
    """Copy-on-write block copies."""
    model_time: float = 0.0
    """Seconds inside ``executor.execute``."""


class Engine:
    """Continuous-batching generation over a paged KV cache.

    Args:
        executor: runs the model (:class:`TorchExecutor`, :class:`OrtExecutor`).
        cache_config: pool sizes and prefix caching (defaults: :class:`CacheConfig`).
        scheduler_config: step limits and preemption mode (defaults: :class:`SchedulerConfig`;
            a budget it leaves to the model is resolved by :meth:`SchedulerConfig.resolved`).
        encoder_decoder: the decoder start token of an encoder-decoder model
            (default: the start token the executor found on the model); ignored otherwise.
        tokenizer: a :class:`~attnexport.runtime.text.Tokenizer`: prompts may then be text,
            and outputs carry ``text`` / ``text_delta`` (default: token ids only).
        grammars: compiles the grammars of requests with ``SamplingParams.structured``
            (:class:`~attnexport.runtime.structured_output.GrammarCompiler`, over the model's
            tokenizer); without it such requests are refused.
    """

    def __init__(
        self,
        executor: Executor,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        encoder_decoder: EncoderDecoderConfig | None = None,
        tokenizer: Tokenizer | None = None,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.executor = executor
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.encoder_decoder = None
        if executor.cache_spec.num_cross_layers:
            start = executor.decoder_start_token_id
            if encoder_decoder is None and start is None:
                raise UserError(
                    "encoder_decoder: the model is an encoder-decoder and states no decoder "
                    "start token; pass EncoderDecoderConfig(decoder_start_token_id=...)"
                )
            self.encoder_decoder = encoder_decoder or EncoderDecoderConfig(start)
            if self.encoder_decoder.decoder_start_token_id >= executor.vocab_size:
                raise UserError(
                    "encoder_decoder: decoder_start_token_id "
                    f"{self.encoder_decoder.decoder_start_token_id} is outside the vocabulary "
                    f"[0, {executor.vocab_size})"
                )
        self.cache_config = cache_config or CacheConfig()
        self.scheduler_config = (scheduler_config or SchedulerConfig()).resolved(
            executor.rope_switch_length
        )
        self.max_model_len = (
            checked_max_model_len(
                self.scheduler_config.max_model_len,
                executor.max_model_len,
                "the positions it was trained for, as its export or config declares them",
            )
            or DEFAULT_MAX_MODEL_LEN
        )
        spec = executor.cache_spec
        self.num_blocks, self.num_cpu_blocks = resolve_num_blocks(
            self.cache_config,
            spec,
            self.scheduler_config.max_num_seqs,
            self.max_model_len,
            executor.device.type,
        )
        executor.initialize_cache(self.num_blocks, self.num_cpu_blocks)
        self.block_manager = BlockManager(
            self.num_blocks,
            self.num_cpu_blocks,
            spec.block_size,
            self.cache_config.enable_prefix_caching,
            cross=self.encoder_decoder is not None,
            rope_switch_length=executor.rope_switch_length,
        )
        self.scheduler = Scheduler(
            self.scheduler_config, self.block_manager, executor.rope_switch_length
        )
        self.limits = RequestLimits(
            executor.vocab_size,
            self.max_model_len,
            self.scheduler_config,
            encoder_decoder=self.encoder_decoder is not None,
            rope_switch_length=executor.rope_switch_length,
        )
        self.outputs = OutputProcessor(self.scheduler, self.block_manager, self.max_model_len)
        self.stats = EngineStats()
        self._requests: dict[str, Request] = {}
        # request id -> the inbox of the stream() that delivers it: requests changed by a step
        # (whichever call ran it), in order, each once; the stream yields their outputs.
        self._inboxes: dict[str, dict[Request, None]] = {}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_path(cls, path, **options) -> Engine:
        """An engine over an export directory, a ``.onnx`` or a ``.pt2`` file.

        Options: ``executor`` (auto|ort|torch), ``backend``, ``device``, ``num_threads``,
        ``max_model_len``, ``trust_pickle`` (see :func:`attnexport.runtime.loading.load_executor`),
        and ``cache_config`` / ``scheduler_config``. Only model files the manifest lists load,
        after their size and SHA-256 are checked; a ``.pt2`` that would unpickle anything is
        refused (:class:`attnexport.artifact.UnsafeArtifactError`) unless ``trust_pickle``.
        """
        return engine_from_path(path, **options)

    def describe(self) -> str:
        """One line: the executor (device, threads, which kernels run the attnexport nodes and,
        when the native onnxruntime kernels are unavailable, why) and the KV-cache pool."""
        return f"{self.executor.describe()}; {self.describe_kv_cache()}"

    def describe_kv_cache(self) -> str:
        """The device pool in one phrase: blocks, tokens, bytes, and the longest sequence."""
        spec = self.executor.cache_spec
        size = self.num_blocks * spec.bytes_per_block
        return (
            f"KV cache: {self.num_blocks} blocks of {spec.block_size} tokens "
            f"({self.num_blocks * spec.block_size} tokens, {size / 2**20:.1f} MiB), "
            f"max_model_len {self.max_model_len}"
        )

    # ------------------------------------------------------------------ requests
    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder_decoder is not None

    def check_request(self, prompt: Sequence[int] | str, params: SamplingParams) -> list[int]:
        """Validates one request; returns the prompt as a list of ints (a text prompt encoded
        with the engine's tokenizer). Raises like :meth:`RequestLimits.check
        <attnexport.runtime.request_checks.RequestLimits.check>`: TypeError for a prompt that
        is not a sequence of ints or params that are not SamplingParams, ValueError for an
        empty or too long prompt, a token id outside the vocabulary or bad parameters."""
        return self.limits.check(prompt, params, self.tokenizer)

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queues a request; returns its id. Raises like :meth:`check_request`."""
        params = params or SamplingParams()
        tokens = self.check_request(prompt, params)
        grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise UserError(
                    "structured: this engine has no grammar compiler (it needs the model's "
                    "tokenizer and the structured extra: pip install 'attnexport[structured]')"
                )
            grammar = self.grammars.compile(params.structured)
        request = self._new_request(tokens, params, request_id)
        if self.encoder_decoder is not None:
            request.encoder = EncoderInput(list(tokens))
            request.prompt = [self.encoder_decoder.decoder_start_token_id]
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        if params.processes_logits:
            request.logits_plan = RequestLogits(
                params, request.user_prompt, self.executor.vocab_size, grammar
            )
        self.outputs.new_sequence(request, list(request.prompt), 0)
        self.scheduler.add(request)
        return request.request_id

    def _new_request(self, tokens: list[int], params, request_id: str | None) -> Request:
        index = next(self._arrivals)
        request_id = request_id if request_id is not None else f"req-{index}"
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        request = Request(request_id, tokens, params, index)
        self._requests[request_id] = request
        return request

    def abort(self, request_id: str) -> None:
        """Stops a request; its blocks are freed and its samples end with ``"aborted"``."""
        request = self._requests.get(request_id)
        if request is None or request.finished:
            return
        aborted = request.unfinished_seqs()
        # Before the samples are marked: the scheduler gives back one slot per live sample.
        self.scheduler.finish(request)
        for seq in aborted:
            seq.finish_reason = "aborted"
        request.finish_time = time.perf_counter()
        self._notify([request])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_output(self, request_id: str) -> RequestOutput:
        return self._output(self._requests[request_id])

    def _output(
        self, request: Request, sent: dict | None = None, texts: dict | None = None
    ) -> RequestOutput:
        """:func:`~attnexport.runtime.outputs.snapshot` of ``request`` with the engine's
        tokenizer. Text that cannot be decoded fails that request (its error set, its blocks
        freed), not the call: its output comes back without text."""
        try:
            return snapshot(request, sent, self.tokenizer, texts)
        except Exception as error:
            if self.tokenizer is None:
                raise
            if request.error is None:
                logger.error(
                    "request %s: decoding its text failed", request.request_id, exc_info=True
                )
                message = f"decoding the text failed: {type(error).__name__}: {error}"
                self.outputs.fail(request, message, time.perf_counter())
            return snapshot(request, sent)

    def release(self, request_id: str) -> None:
        """Forgets a finished request (its output can no longer be fetched)."""
        request = self._requests.get(request_id)
        if request is not None and request.finished:
            del self._requests[request_id]

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step and the model; returns the outputs of the requests that
        changed (new tokens, finished or failed)."""
        return [self._output(request) for request in self._step()]

    def kv_cache_usage(self) -> dict[str, int]:
        """The device pool now: ``num_blocks``, ``blocks_in_use``, ``bytes_in_use`` and
        ``tokens_stored`` (cached tokens of the running sequences; a block shared by forked
        samples counts once per sample)."""
        used = self.block_manager.num_used_blocks()
        stored = sum(
            seq.num_computed
            for request in self._requests.values()
            for seq in request.seqs
            if not seq.finished and seq.block_ids and request.status == Status.RUNNING
        )
        return {
            "num_blocks": self.num_blocks,
            "blocks_in_use": used,
            "bytes_in_use": used * self.executor.cache_spec.bytes_per_block,
            "tokens_stored": stored,
        }

    def _step(self) -> list[Request]:
        """One step; returns the requests it changed, each once, and puts them in the inboxes
        of the streams that deliver them.

        An exception from the block moves or the model fails the step's requests
        (:meth:`_fail_step`: they finish with ``error`` set and their blocks freed; the queued
        requests are untouched) and is raised on: the caller sees its type and traceback (the
        CLI tells a user's mistake from a bug by them) and the engine stays usable. One
        request's sampling failing fails that request only (:class:`OutputProcessor`)."""
        batch = self.scheduler.schedule()
        changed: list[Request] = []
        if batch.failed:
            now = time.perf_counter()
            for request in batch.failed:
                request.finish_time = now
                changed.append(request)
        moved = False
        try:
            self._apply_block_moves(batch)
            moved = True
            if batch.seqs:
                model_input = self._model_input(batch)
                start = time.perf_counter()
                logits = self.executor.execute_numpy(model_input)
                self.stats.model_time += time.perf_counter() - start
                self._account(batch)
                self._mark_computed(batch, start)
                if model_input.sampling_seqs:
                    rows = model_input.sampling_seqs
                    if model_input.sample_rows is not None:  # some rows score prompts
                        logits, rows = self.outputs.score_prompts(batch.seqs, model_input, logits)
                    self.outputs.take_tokens(batch.seqs, rows, logits, changed)
        except BaseException as error:
            self._fail_step(batch, moved, error, changed)
            self._notify(changed)
            raise
        if len(changed) > 1:
            changed = list(dict.fromkeys(changed))
        if self._inboxes:
            self._notify(changed)
        return changed

    def _fail_step(
        self, batch: ScheduledBatch, moved: bool, error: BaseException, changed: list[Request]
    ) -> None:
        """Finishes the requests of a step that raised ``error`` with it (their blocks may hold
        a partial write or miss a copy): the requests in ``batch``, and, when the block moves
        did not complete (``moved`` False), those it swapped out. Adds them to ``changed``."""
        requests = dict.fromkeys(seq.request for seq in batch.seqs)
        if not moved:
            requests.update(dict.fromkeys(r for r in batch.preempted if r.status is Status.SWAPPED))
        message = f"the executor failed: {type(error).__name__}: {error}"
        now = time.perf_counter()
        for request in requests:
            if request.status is Status.FINISHED:
                continue  # it finished in this step before the error
            self.outputs.fail(request, message, now)
            changed.append(request)

    def _notify(self, changed: list[Request]) -> None:
        """Puts the ``changed`` requests in the inboxes of the streams that deliver them."""
        inboxes = self._inboxes
        for request in changed:
            inbox = inboxes.get(request.request_id)
            if inbox is not None:
                inbox[request] = None

    def _mark_computed(self, batch: ScheduledBatch, start: float) -> None:
        """The batch's tokens (and the encoders it ran) are in the cache now; ``start`` is when
        the step's model run began."""
        caching = self.block_manager.device.enable_caching
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            request = seq.request
            if request.encoder is not None:
                request.encoder.encoded = True
            if request.first_scheduled_time is None:
                request.first_scheduled_time = start
            seq.num_computed += count
            if caching:
                self.block_manager.register_full_blocks(seq)

    def _model_input(self, batch: ScheduledBatch) -> ModelInput:
        """Packs the batch (counting the encoder tokens it runs)."""
        block_size = self.executor.cache_spec.block_size
        if self.encoder_decoder is None:
            return pack_decoder_batch(batch, block_size)
        model_input, num_encoder_tokens = pack_encoder_decoder_batch(batch, block_size)
        self.stats.num_encoder_tokens_computed += num_encoder_tokens
        return model_input

    def _apply_block_moves(self, batch: ScheduledBatch) -> None:
        # Order matters: a block swapped out may be reused by a swap-in or a copy in this step,
        # and a copy-on-write source may be a block that was just swapped in.
        if batch.swap_out:
            self.executor.swap_out(batch.swap_out)
        if batch.swap_in:
            self.executor.swap_in(batch.swap_in)
        if batch.copies:
            self.executor.copy_blocks(batch.copies)

    def _account(self, batch: ScheduledBatch) -> None:
        """Counts the batch in :attr:`stats` (before its tokens are marked computed)."""
        stats = self.stats
        stats.num_steps += 1
        stats.num_computed_tokens += batch.num_tokens
        prompt_tokens = hits = 0
        for seq, count in zip(batch.seqs, batch.num_new_tokens, strict=True):
            request, computed = seq.request, seq.num_computed
            prompt_len = request.prompt_len
            if computed < prompt_len:
                prompt_tokens += min(computed + count, prompt_len) - computed
            if computed > 0 and request.first_scheduled_time is None:
                hits += computed
        stats.num_prompt_tokens_computed += prompt_tokens
        stats.num_prefix_cache_hit_tokens += hits
        stats.num_preemptions += len(batch.preempted)
        stats.num_rope_recomputations += len(batch.recomputed)
        stats.num_swapped_out_blocks += len(batch.swap_out)
        stats.num_swapped_in_blocks += len(batch.swap_in)
        stats.num_copied_blocks += len(batch.copies)

    # ------------------------------------------------------------------ batch APIs
    def _submit(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[Request]:
        if isinstance(params, SamplingParams) or params is None:
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"params: expected one SamplingParams per prompt ({len(prompts)}), "
                    f"got {len(params_list)}"
                )
        requests = []
        for prompt, p in zip(prompts, params_list, strict=True):
            try:
                request_id = self.add_request(prompt, p)
                requests.append(self._requests[request_id])
            except (TypeError, ValueError) as error:
                readable = isinstance(prompt, Iterable) and not isinstance(prompt, (str, bytes))
                tokens = list(prompt) if readable else []
                request = self._new_request(tokens, p, None)
                request.error = str(error)
                request.finish_time = request.arrival_time
                requests.append(request)
        return requests

    def stream(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Runs the prompts to completion, yielding a request's output each time it changes
        (``new_token_ids`` holds the tokens since its previous output, ``text_delta`` their
        text when the engine has a tokenizer; the last one has ``finished``). Failed requests
        are yielded first.

        Streams can be consumed alternately, with each other and with :meth:`generate`: a step
        run for one delivers, through its inbox, what it changed for another. Closing the
        generator (``close()``, ``del`` or an exception thrown into it, such as a
        KeyboardInterrupt) aborts its unfinished requests and frees their blocks.
        """
        requests = self._submit(prompts, params)
        inbox: dict[Request, None] = {}
        sent: dict[str, dict[int, int]] = {r.request_id: {} for r in requests}
        texts: dict[str, dict] = {r.request_id: {} for r in requests}
        # Requests whose finished output is not yielded yet, in prompt order.
        undelivered = dict.fromkeys(r for r in requests if r.error is None)
        for request in undelivered:
            self._inboxes[request.request_id] = inbox
        try:
            for request in requests:
                if request.error is not None:
                    rid = request.request_id
                    yield self._output(request, sent[rid], texts[rid])
            while undelivered:
                if not inbox:
                    self._step()
                    if not inbox:
                        # Finished outside a step of this engine's (nothing is left to run).
                        inbox.update(dict.fromkeys(r for r in undelivered if r.finished))
                    continue
                request = next(iter(inbox))
                del inbox[request]
                rid = request.request_id
                output = self._output(request, sent[rid], texts[rid])
                if request.finished:
                    if request not in undelivered:
                        continue  # its finished output is out
                    del undelivered[request]
                elif not any(sample.new_token_ids for sample in output.outputs):
                    continue  # an earlier output of this stream had these tokens
                yield output
        finally:
            for request in requests:
                self._inboxes.pop(request.request_id, None)
                self.abort(request.request_id)
                self.release(request.request_id)

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs the prompts to completion; one output per prompt, in prompt order. An exception
        raised on the way (a KeyboardInterrupt) aborts the prompts' requests first.

        Args:
            prompts: token-id lists (or strings, encoded with the engine's tokenizer).
            params: one SamplingParams for all prompts, or one per prompt (default: greedy,
                16 tokens).
        """
        requests = self._submit(prompts, params)
        try:
            for request in requests:  # requests never become unfinished again
                while not request.finished:
                    self._step()
            return [self._output(r) for r in requests]
        finally:
            for request in requests:
                self.abort(request.request_id)
                self.release(request.request_id)

    def reset_stats(self) -> None:
        self.stats = EngineStats()


def engine_from_path(
    path: str | os.PathLike,
    *,
    cache_config: CacheConfig | None = None,
    scheduler_config: SchedulerConfig | None = None,
    encoder_decoder: EncoderDecoderConfig | None = None,
    tokenizer: Tokenizer | None = None,
    grammars: GrammarCompiler | None = None,
    **executor_options,
) -> Engine:
    """An :class:`Engine` over :func:`~attnexport.runtime.loading.load_executor` ``(path,
    **executor_options)``; an encoder-decoder takes ``encoder_decoder``, else
    :func:`~attnexport.runtime.loading.encoder_decoder_config` of ``path``. ``tokenizer``
    (e.g. ``Tokenizer.from_directory(path)``) makes the engine take text prompts and return
    text."""
    executor = load_executor(path, **executor_options)
    if encoder_decoder is None and executor.cache_spec.num_cross_layers:
        encoder_decoder = encoder_decoder_config(path)
    return Engine(executor, cache_config, scheduler_config, encoder_decoder, tokenizer, grammars)
