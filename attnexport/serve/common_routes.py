"""The routes every served model has, generator or encoder: ``GET /v1/models/{id}``, and
vLLM's ``POST /tokenize`` and ``POST /detokenize`` (its request and response shapes). Bodies
are read within the request-size limit and parsed, tokenized and templated in a worker thread,
as the generation routes do."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Request

from attnexport.runtime.chat_template import ChatTemplateError, TemplateLimits
from attnexport.runtime.text import Tokenizer, TokenizerError
from attnexport.serve.errors import InvalidRequest, model_not_found
from attnexport.serve.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from attnexport.serve.request_body import parse_body, read_body

T = TypeVar("T")
TEMPLATE_CHARS_PER_BYTE = 8
TEMPLATE_MIN_CHARS = 1 << 20


class RouteContext:
    """What the shared routes need of a served model.

    Args:
        name: the served model's id.
        tokenizer: its tokenizer (None: these routes answer 400).
        max_model_len: its maximum length (``/tokenize`` reports it).
        max_request_bytes: the body limit (413 past it).
        template_seconds: CPU seconds one chat-template render may take.
        vocab_size: ids ``/detokenize`` takes are below it.
    """

    def __init__(
        self,
        name: str,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        max_request_bytes: int,
        template_seconds: float,
        vocab_size: int,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_request_bytes = max_request_bytes
        self.template_seconds = template_seconds
        self.vocab_size = vocab_size
        self._limiter = None

    def check_model(self, body: ModelRequest) -> None:
        if body.model is not None and body.model != self.name:
            raise model_not_found(body.model, self.name)

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, max_model_len=self.max_model_len)

    def need_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequest(
                f"{field}: the model {self.name!r} has no tokenizer (its artifact holds none)",
                field,
            )
        return self.tokenizer

    async def in_worker(self, request: Request, work: Callable[[bytes], T]) -> T:
        """Reads the body (413 past the limit) and runs ``work(raw)`` in a worker thread."""
        import anyio
        import anyio.to_thread

        raw = await read_body(request, self.max_request_bytes)
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(4)
        return await anyio.to_thread.run_sync(work, raw, limiter=self._limiter)

    # ------------------------------------------------------------------ worker threads
    def tokenize(self, raw: bytes) -> TokenizeResponse:
        body = parse_body(raw, TokenizeRequest)
        self.check_model(body)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt: give either prompt or messages")
        if body.prompt is not None:
            tokenizer = self.need_tokenizer("prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            encoded = tokenizer.hf(
                body.prompt, add_special_tokens=special, padding=False, truncation=False
            )
            ids = list(encoded["input_ids"])
        else:
            tokenizer = self.need_tokenizer("messages")
            limits = TemplateLimits(
                cpu_seconds=self.template_seconds,
                max_chars=TEMPLATE_MIN_CHARS + TEMPLATE_CHARS_PER_BYTE * len(raw),
            )
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            try:
                ids = tokenizer.apply_chat_template(
                    [m.as_template_message() for m in body.messages],
                    limits,
                    tools,
                    add_generation_prompt=body.add_generation_prompt,
                )
            except (TokenizerError, ChatTemplateError) as error:
                raise InvalidRequest(f"messages: {error}", "messages") from None
            if body.add_special_tokens:
                ids = tokenizer.hf.build_inputs_with_special_tokens(ids)
        strs = tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, raw: bytes) -> DetokenizeResponse:
        body = parse_body(raw, DetokenizeRequest)
        self.check_model(body)
        tokenizer = self.need_tokenizer("tokens")
        bad = next((t for t in body.tokens if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"tokens: token id {bad} is outside the vocabulary; expected ids in "
                f"[0, {self.vocab_size})",
                "tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def add_common_routes(app: FastAPI, context: RouteContext) -> None:
    """``GET /v1/models/{id}``, ``POST /tokenize`` and ``POST /detokenize`` on ``app``."""
    created = int(time.time())

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> ModelCard:
        if model_id != context.name:
            raise model_not_found(model_id, context.name)
        return ModelCard(id=context.name, max_model_len=context.max_model_len, created=created)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> TokenizeResponse:
        return (await context.in_worker(request, context.tokenize)).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await context.in_worker(request, context.detokenize)
