"""The server of an encoder artifact: OpenAI's ``POST /v1/embeddings`` over
:class:`~attnexport.runtime.embedding.EmbeddingEngine` (the path of ``attnexport embed``, so a
vector equals that command's), with ``/v1/models``, ``/tokenize``, ``/detokenize``, ``/health``.

Each request's inputs are embedded as one packed batch (split by the engine's token budget) in
a worker thread, one request at a time (the encoder's threads are the machine's); texts are
tokenized as sentence-transformers does (special tokens, truncated to ``max_seq_length``),
token-id inputs are taken as given. ``encoding_format: base64`` sends each vector's float32
little-endian bytes in base64 (what OpenAI's client decodes)."""

from __future__ import annotations

import base64

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnexport.errors import UserError
from attnexport.serve.common_routes import RouteContext, add_common_routes
from attnexport.serve.errors import APIError, InvalidRequest, server_error
from attnexport.serve.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
    ModelList,
)
from attnexport.serve.request_body import default_max_request_bytes, parse_body
from attnexport.serve.served_model import ServedEncoder


def create_embedding_app(
    model: ServedEncoder, *, max_request_bytes: int | None = None, template_seconds: float = 2.0
) -> FastAPI:
    """The ASGI app serving ``model``'s embeddings."""
    limit = max_request_bytes or default_max_request_bytes(model.max_model_len)
    vocab = model.embedder.executor.vocab_size or (
        len(model.tokenizer.hf) if model.tokenizer else 0
    )
    context = RouteContext(
        model.name, model.tokenizer, model.max_model_len, limit, template_seconds, vocab
    )
    app = FastAPI(title="attnexport")
    add_error_handlers(app)
    add_common_routes(app, context)
    embed_limiter = []

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[context.card()])

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        import anyio

        if not embed_limiter:
            embed_limiter.append(anyio.CapacityLimiter(1))
        body = await context.in_worker(request, _parse)
        context.check_model(body)
        response = await anyio.to_thread.run_sync(
            _embed, model, context, body, limiter=embed_limiter[0]
        )
        return JSONResponse(response.model_dump())

    for route in ("/v1/completions", "/v1/chat/completions"):

        @app.post(route)
        async def generation(request: Request) -> Response:
            raise InvalidRequest(
                f"the model {model.name!r} is an encoder (embeddings): it serves "
                "/v1/embeddings, not text generation"
            )

    return app


def _parse(raw: bytes) -> EmbeddingRequest:
    return parse_body(raw, EmbeddingRequest)


def _embed(model: ServedEncoder, context: RouteContext, body: EmbeddingRequest):
    inputs = body.input
    embedder = model.embedder
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], str)):
        texts = [inputs] if isinstance(inputs, str) else inputs
        tokenizer = context.need_tokenizer("input")
        try:
            ids, types = embedder.tokenize(texts, tokenizer)
        except UserError as error:
            raise InvalidRequest(f"input: {error}", "input") from None
    else:
        ids = [inputs] if isinstance(inputs[0], int) else inputs
        types = None
    try:
        vectors = embedder.embed(ids, types)
    except UserError as error:
        raise InvalidRequest(f"input: {error}", "input") from None
    if body.dimensions is not None and body.dimensions != vectors.shape[1]:
        raise InvalidRequest(
            f"dimensions: the model's embeddings have {vectors.shape[1]} dimensions and are "
            f"not truncated; got {body.dimensions}",
            "dimensions",
        )
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [
        Embedding(
            index=i,
            embedding=(
                base64.b64encode(vector.tobytes()).decode("ascii")
                if body.encoding_format == "base64"
                else vector.tolist()
            ),
        )
        for i, vector in enumerate(vectors)
    ]
    tokens = sum(len(s) for s in ids)
    return EmbeddingResponse(
        data=data,
        model=model.name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped bodies for :class:`APIError`, HTTP errors and anything unexpected."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        code = "not_found" if error.status_code == 404 else None
        api = APIError(error.status_code, str(error.detail), kind, code=code)
        return JSONResponse(api.body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        api = server_error(f"internal error: {type(error).__name__}: {error}")
        return JSONResponse(api.body(), status_code=500)
