"""The HTTP server: OpenAI's completions, chat completions and models routes, health and
Prometheus metrics, over one :class:`~attnexport.serve.async_engine.AsyncEngine` (FastAPI).

    app = create_app(load_served_model("export/"), max_queued_requests=256)
    uvicorn.run(app, host="127.0.0.1", port=8000)

A request's body is read up to ``max_request_bytes`` (413 past it); parsing, validation,
tokenization and the chat template run in a worker thread (at most ``PREPARE_THREADS`` at
once), not on the event loop (but for token-id completions of at most
``INLINE_BODY_BYTES``, whose work is small), and the chat template within a CPU-time and size
limit
(:mod:`attnexport.runtime.chat_template`). The event loop only queues the checked prompts and
turns the engine's outputs into responses: each sample through an incremental detokenizer,
so streamed deltas never split a character and concatenate to the full text, then through the
request's stop strings. Responses follow OpenAI's shapes; ``stream: true`` sends server-sent
events ending with ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnexport._version import __version__
from attnexport.errors import UserError
from attnexport.runtime.chat_template import ChatTemplateError, TemplateLimitError, TemplateLimits
from attnexport.runtime.logprobs import TokenLogprobs
from attnexport.runtime.outputs import CompletionOutput, RequestOutput
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.text import TokenizerError
from attnexport.serve.async_engine import (
    AsyncEngine,
    EngineStoppedError,
    QueueFullError,
    RequestGroup,
)
from attnexport.serve.common_routes import RouteContext, add_common_routes
from attnexport.serve.embeddings import create_embedding_app
from attnexport.serve.errors import (
    APIError,
    InvalidRequest,
    model_not_found,
    server_error,
    unavailable,
)
from attnexport.serve.logprob_format import (
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from attnexport.serve.metrics import ServerMetrics
from attnexport.serve.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    FunctionCallOut,
    ModelCard,
    ModelList,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)
from attnexport.serve.request_body import default_max_request_bytes, parse_body, read_body
from attnexport.serve.request_params import ToolUse, sampling_extras
from attnexport.serve.served_model import ServedEncoder, ServedModel
from attnexport.serve.stop import StopStrings
from attnexport.serve.tool_calls import CallStream, ParsedCall, parse_calls

logger = logging.getLogger("attnexport.serve")

PREPARE_THREADS = 4
"""Requests parsed, tokenized and templated at once (worker threads; more wait their turn)."""
INLINE_BODY_BYTES = 8 << 10
"""A completion of token ids with a body this small is parsed and checked on the event loop (a
millisecond at most): under load, the hand-offs to a worker thread and back each wait for the
GIL and cost more than the work. Text (tokenization) and chat (the template, the artifact's
code) always go to a thread."""
CHAT_TEMPLATE_SECONDS = 2.0
"""CPU seconds one chat template render may take."""
CHAT_TEMPLATE_CHARS_PER_BYTE = 8
CHAT_TEMPLATE_MIN_CHARS = 1 << 20
"""A render may produce ``1 Mi + 8 * (the request body's bytes)`` characters in all (its
output, and every string it makes on the way): work proportional to the request."""

T = TypeVar("T")


def create_app(
    model: ServedModel | ServedEncoder,
    *,
    max_queued_requests: int | None = None,
    shutdown_timeout: float = 10.0,
    max_request_bytes: int | None = None,
    chat_template_seconds: float = CHAT_TEMPLATE_SECONDS,
) -> FastAPI:
    """The server's ASGI app. Its lifespan starts the engine's driver thread and, at shutdown
    (after uvicorn stopped accepting connections and let the open ones finish), aborts what is
    left and stops the driver.

    Args:
        model: what to serve (:func:`~attnexport.serve.served_model.load_served_model`); an
            encoder is served for its embeddings
            (:func:`~attnexport.serve.embeddings.create_embedding_app`).
        max_queued_requests: requests that may wait for a slot before new ones get a 503
            (None: no limit); a request with more prompts than this is a 400.
        shutdown_timeout: seconds to wait for the driver's last step at shutdown.
        max_request_bytes: the largest request body (413 past it); default
            :func:`~attnexport.serve.request_body.default_max_request_bytes`.
        chat_template_seconds: CPU seconds one chat template render may take (a 400 past
            them).
    """
    if isinstance(model, ServedEncoder):
        return create_embedding_app(
            model, max_request_bytes=max_request_bytes, template_seconds=chat_template_seconds
        )
    metrics = ServerMetrics(model.name)
    metrics.bytes_per_block = model.engine.executor.cache_spec.bytes_per_block
    engine = AsyncEngine(model.engine, max_queued_requests, on_step=metrics.on_step)
    metrics.on_step(engine.state, None)
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(model.max_model_len)
    _check_chat_template(model, chat_template_seconds)
    server = _Server(model, engine, metrics, max_request_bytes, chat_template_seconds)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown(shutdown_timeout)

    app = FastAPI(title="attnexport", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        if error.status in (400, 404, 413):
            metrics.rejected.labels(model.name, str(error.status)).inc()
        headers = {"Retry-After": "1"} if error.status == 503 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        code = "not_found" if error.status_code == 404 else None
        api = APIError(error.status_code, str(error.detail), kind, code=code)
        return JSONResponse(api.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error")
        api = server_error(f"internal error: {type(error).__name__}: {error}")
        return JSONResponse(api.body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        if not engine.running:
            raise unavailable("the engine is not running", code="engine_stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model.name, max_model_len=model.max_model_len)])

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    add_common_routes(
        app,
        RouteContext(
            model.name,
            model.tokenizer,
            model.max_model_len,
            max_request_bytes,
            chat_template_seconds,
            model.engine.executor.vocab_size,
        ),
    )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.chat(request)

    return app


def _is_token_ids(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """A completion whose prompts need no tokenizer (and no grammar to compile, no prompt to
    decode for ``echo``)."""
    prompt = getattr(body, "prompt", None)
    if prompt is None or isinstance(prompt, str) or body.echo:
        return False
    if body.response_format is not None and body.response_format.type != "text":
        return False
    return not prompt or not isinstance(prompt[0], str)


def _check_chat_template(model: ServedModel, seconds: float) -> None:
    """Refuses a chat template that cannot render a one-message conversation within the
    server's limits: every chat request would fail. (A template that refuses the message, as
    one requiring a system message does, is its business.)"""
    tokenizer = model.tokenizer
    if tokenizer is None or not tokenizer.has_chat_template:
        return
    limits = TemplateLimits(cpu_seconds=seconds, max_chars=CHAT_TEMPLATE_MIN_CHARS)
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], limits)
    except TemplateLimitError as error:
        raise UserError(
            f"{model.name}: its chat template cannot render a one-message conversation "
            f"within the server's limits: {error}"
        ) from None
    except (TokenizerError, ChatTemplateError):
        pass


# ---------------------------------------------------------------------- choices
@dataclass
class _Choice:
    """One sample's text as it streams: detokenized, then cut at the first stop string."""

    detokenizer: object | None
    stops: StopStrings
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    new_ids: list[int] = field(default_factory=list)
    """The tokens the last :meth:`update` took."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One entry per token of ``token_ids`` when the request asked for logprobs."""
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    calls: CallStream | None = None
    """Chat with tools: the text that may hold tool calls."""
    offset: int = 0
    """Completions streams: characters of token text sent (logprobs' text offsets)."""
    echoed: bool = False
    """A completions stream sent its prompt's echo."""

    def update(self, sample: CompletionOutput) -> str:
        """Takes the sample's new tokens; returns the text they add (maybe empty: a partial
        character or word is held back)."""
        self.new_ids, self.new_logprobs = [], []
        if self.finish_reason is not None:
            return ""
        self.new_ids = list(sample.new_token_ids)
        self.token_ids += self.new_ids
        if sample.logprobs is not None and self.new_ids:
            self.new_logprobs = sample.logprobs[len(sample.logprobs) - len(self.new_ids) :]
            self.logprobs += self.new_logprobs
        final = sample.finish_reason is not None
        delta = ""
        if self.detokenizer is not None:
            delta = self.detokenizer.push(sample.new_token_ids)
            if final:
                delta += self.detokenizer.finish()
        delta = self.stops.push(delta, final)
        self.text += delta
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = sample.finish_reason
        return delta


@dataclass
class _Prompt:
    """One prompt of a request: its ids, its choices (``n`` samples), and its output state."""

    token_ids: list[int]
    choices: list[_Choice]
    error: APIError | None = None
    """What the request answers when the engine failed this prompt."""
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class _Prepared:
    """A request parsed and checked in a worker thread, ready to queue."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    arrival: float
    chat: bool
    tools: ToolUse | None = None
    """How the answer is read for tool calls (chat with tools)."""
    echo: list[str] | None = None
    """Completions with ``echo``: each prompt's text."""


class _Server:
    """The routes' work: requests to engine prompts and parameters, outputs to responses."""

    def __init__(
        self,
        model: ServedModel,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        max_request_bytes: int,
        chat_template_seconds: float,
    ):
        self.model = model
        self.engine = engine
        self.metrics = metrics
        self.max_request_bytes = max_request_bytes
        self.chat_template_seconds = chat_template_seconds
        self._limiter = None  # an anyio CapacityLimiter, made on the event loop
        self.texts = TokenTexts(model.tokenizer)
        """Token texts of log-probabilities (decoded once per id, on the event loop)."""
        # Which server answered (replicas behind a load balancer or Ray Serve).
        self.fingerprint = f"attnexport-{__version__}-{uuid.uuid4().hex[:12]}"

    # ------------------------------------------------------------------ routes
    async def completions(self, request: Request) -> Response:
        return await self._serve(
            request,
            CompletionRequest,
            self._prepare_completion,
            self._completion_chunks,
            self._completion_response,
        )

    async def chat(self, request: Request) -> Response:
        return await self._serve(
            request,
            ChatCompletionRequest,
            self._prepare_chat,
            self._chat_chunks,
            self._chat_response,
        )

    async def _serve(self, request: Request, model, prepare, chunks, respond) -> Response:
        """Reads the body (of type ``model``), prepares it (``prepare``, off the event loop but
        for small token-id requests), queues it, and answers with ``respond`` (the whole
        response) or a stream of ``chunks``."""
        import anyio.to_thread

        arrival = time.perf_counter()
        raw = await read_body(request, self.max_request_bytes)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(PREPARE_THREADS)

        def in_thread(function: Callable[[], T]) -> Awaitable[T]:
            return anyio.to_thread.run_sync(function, limiter=self._limiter)

        if len(raw) <= INLINE_BODY_BYTES:
            body = parse_body(raw, model)
            if _is_token_ids(body):
                prepared = prepare(body, len(raw), arrival)
            else:
                prepared = await in_thread(lambda: prepare(body, len(raw), arrival))
        else:
            prepared = await in_thread(lambda: prepare(parse_body(raw, model), len(raw), arrival))
        body = prepared.body
        run = self._start(prepared)
        if body.stream:
            return self._sse(run, chunks(body, run), request)
        await _unless_disconnected(request, run.drain(self), run)
        return JSONResponse(respond(body, run).model_dump(exclude_none=True))

    # ------------------------------------------------------------------ worker threads
    def _prepare_completion(self, body: CompletionRequest, size: int, arrival: float) -> _Prepared:
        self._check_model(body)
        prompts = self._completion_prompts(body.prompt)
        prepared = self._checked(body, prompts, body.max_tokens, arrival, chat=False)
        if body.echo:
            texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
            if not all(isinstance(t, str) for t in texts):
                texts = [self._decode(p) for p in prepared.prompts]
            prepared.echo = texts
        return prepared

    def _decode(self, ids: list[int]) -> str:
        tokenizer = self.model.tokenizer
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def _prepare_chat(self, body: ChatCompletionRequest, size: int, arrival: float) -> _Prepared:
        """``size``: the body's bytes (the chat template's budget grows with them)."""
        self._check_model(body)
        tokenizer = self.model.tokenizer
        if tokenizer is None:
            raise InvalidRequest(
                f"messages: the model {self.model.name!r} has no tokenizer (its artifact "
                "holds none), so it takes token-id prompts on /v1/completions only",
                "messages",
            )
        limits = TemplateLimits(
            cpu_seconds=self.chat_template_seconds,
            max_chars=CHAT_TEMPLATE_MIN_CHARS + CHAT_TEMPLATE_CHARS_PER_BYTE * size,
        )
        messages = [m.as_template_message() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            ids = tokenizer.apply_chat_template(messages, limits, tools)
        except (TokenizerError, ChatTemplateError) as error:
            message = str(error)
            message = message if message.startswith("messages") else f"messages: {message}"
            raise InvalidRequest(message, "messages") from None
        limit = body.max_completion_tokens or body.max_tokens
        return self._checked(body, [ids], limit, arrival, chat=True)

    def _check_model(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != self.model.name:
            raise model_not_found(body.model, self.model.name)

    def _completion_prompts(self, prompt) -> list[list[int]]:
        """The ``prompt`` field as token-id lists: a string, a list of strings, a list of ids
        or a list of id lists."""
        if prompt and not isinstance(prompt, str) and not isinstance(prompt[0], int):
            try:  # before any is encoded
                self.engine.check_count(len(prompt))
            except ValueError as error:
                raise InvalidRequest(str(error)) from None
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
            texts = [prompt] if isinstance(prompt, str) else prompt
            tokenizer = self.model.tokenizer
            if tokenizer is None:
                raise InvalidRequest(
                    f"prompt: the model {self.model.name!r} has no tokenizer (its artifact "
                    "holds none); send token ids instead",
                    "prompt",
                )
            return [tokenizer.encode(text) for text in texts]
        if not prompt:
            raise InvalidRequest("prompt: expected at least one token, got an empty prompt")
        if isinstance(prompt[0], int):
            return [prompt]
        return prompt

    def _params(self, body, prompt_len: int, max_tokens: int | None, extras) -> SamplingParams:
        model = self.model
        if body.stop and self.model.tokenizer is None:
            raise InvalidRequest("stop: stop strings need the model's tokenizer", "stop")
        if max_tokens is None:  # what is left of the model's length
            max_tokens = max(1, model.max_model_len - prompt_len)
        stops = () if body.ignore_eos else model.eos_token_ids
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if body.temperature is None else float(body.temperature),
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else float(body.top_p),
            seed=body.seed,
            # a set: the engine checks every generated token against it
            stop_token_ids=frozenset((*stops, *(body.stop_token_ids or ()))),
            n=body.n,
            forced_bos_token_id=model.forced_bos_token_id,
            forced_eos_token_id=model.forced_eos_token_id,
            **extras,
        )

    def _checked(self, body, prompts, max_tokens, arrival: float, chat: bool) -> _Prepared:
        """Sampling parameters for each prompt, and every prompt checked by the engine."""
        extras, tools = sampling_extras(body, self.model)
        params = [self._params(body, len(p), max_tokens, extras) for p in prompts]
        try:
            tokens = self.engine.check_all(prompts, params)
        except (TypeError, ValueError) as error:
            param = "messages" if chat and str(error).startswith("prompt:") else None
            raise InvalidRequest(str(error), param) from None
        return _Prepared(body, tokens, params, arrival, chat, tools=tools)

    # ------------------------------------------------------------------ event loop
    def _start(self, prepared: _Prepared) -> _Run:
        body = prepared.body
        try:
            group = self.engine.enqueue(prepared.prompts, prepared.params)
        except QueueFullError as error:
            self.metrics.rejected.labels(self.model.name, "503").inc()
            raise unavailable(str(error)) from None
        except EngineStoppedError as error:
            raise unavailable(str(error), code="engine_stopped") from None
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        tokenizer = self.model.tokenizer
        runs = [
            _Prompt(
                ids,
                [
                    _Choice(tokenizer.detokenizer() if tokenizer else None, StopStrings(stops))
                    for _ in range(body.n)
                ],
            )
            for ids in prepared.prompts
        ]
        for ids in prepared.prompts:
            self.metrics.prompt_tokens.inc(len(ids))
        prefix = "chatcmpl" if prepared.chat else "cmpl"
        run = _Run(f"{prefix}-{uuid.uuid4().hex}", group, runs, prepared.arrival)
        run.tools, run.echo = prepared.tools, prepared.echo
        if run.tools is not None:
            for choice in run.choices():
                choice.calls = CallStream(run.tools.format, run.tools.forced)
        return run

    # ------------------------------------------------------------------ outputs
    def take(self, run: _Run, index: int, output: RequestOutput) -> list[tuple[int, str]]:
        """An engine output of prompt ``index``: updates its choices; returns the choices
        that changed as (choice index, text delta). Aborts the request once a stop string
        ended all its samples."""
        prompt = run.prompts[index]
        now = run.group.time
        new_tokens = sum(len(s.new_token_ids) for s in output.outputs)
        if new_tokens:
            self.metrics.generation_tokens.inc(new_tokens)
            if prompt.first_token_time is None:
                prompt.first_token_time = now
                self.metrics.time_to_first_token.observe(now - run.arrival)
            else:
                self.metrics.inter_token_latency.observe(now - prompt.last_token_time)
            prompt.last_token_time = now
        if output.error is not None:
            prompt.error = _engine_error(output.error, output.error_is_internal)
        if output.prompt_logprobs is not None and prompt.prompt_logprobs is None:
            prompt.prompt_logprobs = output.prompt_logprobs
        changed = []
        n = len(prompt.choices)
        for sample in output.outputs:
            choice = prompt.choices[sample.index]
            was_done = choice.finish_reason is not None
            delta = choice.update(sample)
            if delta or choice.new_ids or (choice.finish_reason is not None and not was_done):
                changed.append((index * n + sample.index, delta))
        done = all(c.finish_reason is not None for c in prompt.choices)
        if done and not output.finished:
            run.group.abort_one(index)  # stop strings ended every sample
        if (done or output.finished) and index not in run.done:
            run.done.add(index)
            self.metrics.request_latency.observe(now - run.arrival)
        return changed

    def _check_failed(self, run: _Run) -> None:
        """A prompt that failed in the engine fails the request (after its stream ended)."""
        for prompt in run.prompts:
            if prompt.error is not None:
                raise prompt.error
            if any(c.finish_reason == "aborted" for c in prompt.choices):
                raise unavailable("the request was aborted: the server is shutting down")

    def _usage(self, run: _Run) -> Usage:
        prompt = sum(len(p.token_ids) for p in run.prompts)
        completion = sum(len(c.token_ids) for p in run.prompts for c in p.choices)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _completion_response(self, body: CompletionRequest, run: _Run) -> CompletionResponse:
        self._check_failed(run)
        choices = []
        n = len(run.prompts[0].choices)
        for i, choice in enumerate(run.choices()):
            prompt = run.prompts[i // n]
            text, ids, entries = choice.text, choice.token_ids, choice.logprobs
            if run.echo is not None:
                text = run.echo[i // n] + text
                if body.logprobs is not None:
                    ids, entries = prompt.token_ids + ids, prompt.prompt_logprobs + entries
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    finish_reason=choice.finish_reason,
                    token_ids=choice.token_ids if body.return_token_ids else None,
                    logprobs=(
                        completion_logprobs(entries, ids, self.texts)
                        if body.logprobs is not None
                        else None
                    ),
                    prompt_logprobs=self._prompt_logprobs(body, prompt),
                )
            )
        return CompletionResponse(
            id=run.id,
            model=self.model.name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=self._usage(run),
            prompt_token_ids=[p.token_ids for p in run.prompts] if body.return_token_ids else None,
        )

    def _prompt_logprobs(self, body, prompt: _Prompt):
        if body.prompt_logprobs is None:
            return None
        return prompt_logprobs(prompt.prompt_logprobs, self.texts)

    def _chat_response(self, body: ChatCompletionRequest, run: _Run) -> ChatCompletionResponse:
        self._check_failed(run)
        choices = []
        for i, choice in enumerate(run.choices()):
            content, calls = choice.text, []
            if run.tools is not None:
                content, calls = parse_calls(choice.text, run.tools.format)
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=content, tool_calls=_calls_out(calls)),
                    finish_reason=_finish_reason(choice, calls),
                    token_ids=choice.token_ids if body.return_token_ids else None,
                    logprobs=chat_logprobs(choice.logprobs, self.texts) if body.logprobs else None,
                )
            )
        return ChatCompletionResponse(
            id=run.id,
            model=self.model.name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=self._usage(run),
            prompt_token_ids=run.prompts[0].token_ids if body.return_token_ids else None,
            prompt_logprobs=self._prompt_logprobs(body, run.prompts[0]),
        )

    # ------------------------------------------------------------------ streaming
    async def _completion_chunks(self, body: CompletionRequest, run: _Run) -> AsyncIterator[str]:
        created = int(time.time())
        n = len(run.prompts[0].choices)
        async for index, output in run.group:
            for i, delta in self.take(run, index, output):
                choice = run.choice(i)
                prompt = run.prompts[i // n]
                ids, entries = choice.new_ids, choice.new_logprobs
                first = run.echo is not None and not choice.echoed
                if first:  # the prompt goes before the first generated text
                    choice.echoed = True
                    delta = run.echo[i // n] + delta
                    if body.logprobs is not None:
                        ids, entries = prompt.token_ids + ids, prompt.prompt_logprobs + entries
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(entries, ids, self.texts, choice.offset)
                    choice.offset += sum(len(token) for token in logprobs.tokens)
                out = CompletionChoice(
                    index=i,
                    text=delta,
                    finish_reason=choice.finish_reason,
                    token_ids=choice.new_ids if body.return_token_ids else None,
                    logprobs=logprobs,
                    prompt_logprobs=self._prompt_logprobs(body, prompt) if first else None,
                )
                chunk = self._stream_chunk(CompletionChunk, run, created, [out])
                yield _choice_event(chunk, choice.finish_reason)
        self._check_failed(run)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield self._usage_event(CompletionChunk, run, created)

    async def _chat_chunks(self, body: ChatCompletionRequest, run: _Run) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(i: int, delta: DeltaMessage, reason: str | None, ids=None, logprobs=None) -> str:
            out = ChatChunkChoice(
                index=i, delta=delta, finish_reason=reason, token_ids=ids, logprobs=logprobs
            )
            value = self._stream_chunk(ChatCompletionChunk, run, created, [out])
            return _choice_event(value, reason)

        for i in range(len(run.choices())):
            yield chunk(i, DeltaMessage(role="assistant", content=""), None)
        async for index, output in run.group:
            for i, delta in self.take(run, index, output):
                choice = run.choice(i)
                ids = choice.new_ids if body.return_token_ids else None
                logprobs = chat_logprobs(choice.new_logprobs, self.texts) if body.logprobs else None
                reason, calls = choice.finish_reason, []
                if choice.calls is not None:
                    delta = choice.calls.push(delta)
                    if reason is not None:
                        rest, calls = choice.calls.finish()
                        delta += rest
                        reason = _finish_reason(choice, calls)
                if calls:
                    if delta or logprobs is not None:
                        yield chunk(i, DeltaMessage(content=delta), None, ids, logprobs)
                    tool_calls = [
                        ToolCallDelta(
                            index=k,
                            id=call.id,
                            type="function",
                            function=FunctionCallOut(name=call.name, arguments=call.arguments),
                        )
                        for k, call in enumerate(calls)
                    ]
                    yield chunk(i, DeltaMessage(tool_calls=tool_calls), reason)
                elif delta or reason is not None or choice.calls is None:
                    yield chunk(i, DeltaMessage(content=delta), reason, ids, logprobs)
        self._check_failed(run)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield self._usage_event(ChatCompletionChunk, run, created)

    def _usage_event(self, chunk_type, run: _Run, created: int) -> str:
        """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
        usage = self._stream_chunk(chunk_type, run, created, [], self._usage(run))
        return _event(usage.model_dump(exclude_none=True))

    def _stream_chunk(self, chunk_type, run: _Run, created: int, choices: list, usage=None):
        """A ``chunk_type`` (CompletionChunk or ChatCompletionChunk) of ``run``'s stream: its
        id, creation time, model and fingerprint, with ``choices``."""
        return chunk_type(
            id=run.id,
            created=created,
            model=self.model.name,
            system_fingerprint=self.fingerprint,
            choices=choices,
            usage=usage,
        )

    def _sse(self, run: _Run, chunks: AsyncIterator[str], request: Request) -> StreamingResponse:
        """Server-sent events over ``chunks``, then ``data: [DONE]``. An error after the
        headers went out (the engine failed, the server is stopping) is sent as an
        ``{"error": ...}`` event. A client that disconnects cancels the response; the
        background task then aborts what is still running."""

        async def events() -> AsyncIterator[str]:
            try:
                async for event in chunks:
                    yield event
            except APIError as error:
                yield _event(error.body())
            finally:
                run.group.abort()
            yield "data: [DONE]\n\n"

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            background=BackgroundTask(run.group.abort),
        )


@dataclass
class _Run:
    """A request in flight: its id, its engine requests and their choices."""

    id: str
    group: RequestGroup
    prompts: list[_Prompt]
    arrival: float
    done: set[int] = field(default_factory=set)
    tools: ToolUse | None = None
    echo: list[str] | None = None

    def choices(self) -> list[_Choice]:
        return [c for p in self.prompts for c in p.choices]

    def choice(self, i: int) -> _Choice:
        n = len(self.prompts[0].choices)
        return self.prompts[i // n].choices[i % n]

    async def drain(self, server: _Server) -> None:
        """Consumes every output (non-streaming responses)."""
        async for index, output in self.group:
            server.take(self, index, output)


def _calls_out(calls: list[ParsedCall]) -> list[ToolCallOut] | None:
    if not calls:
        return None
    return [
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def _finish_reason(choice: _Choice, calls: list[ParsedCall]) -> str | None:
    """``tool_calls`` for a sample that ended by itself (not by length) with calls."""
    return "tool_calls" if calls and choice.finish_reason == "stop" else choice.finish_reason


def _engine_error(message: str, internal: bool) -> APIError:
    """A request the engine failed: by its own fault (400) or the engine's (500)."""
    return server_error(message) if internal else InvalidRequest(message)


def _choice_event(chunk, finish_reason: str | None) -> str:
    """A chunk of one choice; its ``finish_reason`` is sent as null until the last chunk, as
    OpenAI sends it (the other unset fields are left out)."""
    data = chunk.model_dump(exclude_none=True, exclude={"usage"})
    data["choices"][0]["finish_reason"] = finish_reason
    return _event(data)


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[None], run: _Run) -> None:
    """Awaits ``work`` unless the client disconnects first; then aborts the run's requests
    (their blocks are free after the engine's next step). Starlette does not cancel a
    handler whose client left, so the disconnect is watched here."""

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, watch):
            task.cancel()
        run.group.abort()
    if work_task.done() and not work_task.cancelled():
        work_task.result()
    else:
        raise APIError(499, "the client disconnected", "client_closed_request")
