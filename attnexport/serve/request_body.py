"""A request's body, bounded and parsed: read up to ``--max-request-bytes`` (413 past it,
checked against ``Content-Length`` before reading and while reading, so a chunked body cannot
go past it either), then decoded from JSON and validated into a :mod:`protocol` model with
every failure a 400 naming its field. Parsing is plain CPU work: the server runs
:func:`parse_body` in a worker thread, never on the event loop."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from attnexport.serve.errors import APIError, InvalidRequest
from attnexport.serve.protocol import (
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_MESSAGE_FIELDS,
    ChatMessage,
)

MIN_MAX_REQUEST_BYTES = 4 << 20
BYTES_PER_TOKEN = 32
"""The default ``--max-request-bytes`` is ``max(4 MiB, 32 * max_model_len)``: room for a
prompt of the model's whole length as token ids (at most 8 bytes each: ``"49151, "``) or as
text, even escaped (``"\\u00e9"`` is 6 bytes a character, a few characters a token)."""

Model = TypeVar("Model", bound=BaseModel)


def default_max_request_bytes(max_model_len: int) -> int:
    return max(MIN_MAX_REQUEST_BYTES, BYTES_PER_TOKEN * max_model_len)


def too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes "
        "(--max-request-bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 :class:`APIError` once it is larger than ``limit`` bytes (what was
    read is dropped; uvicorn discards the rest)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(raw: bytes, model: type[Model]) -> Model:
    """``raw`` (JSON) validated as ``model``; :class:`InvalidRequest` (400) naming the field,
    ``param`` null for a body that is not JSON or not an object."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("the body is not valid JSON: it is nested too deeply") from None
    except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8/16/32
        raise InvalidRequest(f"the body is not valid JSON: {error}") from None
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error, model) from None
    except RecursionError:
        raise InvalidRequest("the body is nested too deeply") from None


def validation_error(error: ValidationError, model: type[BaseModel]) -> InvalidRequest:
    """A pydantic error as one 400: ``param`` is the top-level field, the message names the
    whole path (``stop_token_ids.0: ...``)."""
    errors = error.errors(include_url=False, include_input=False, include_context=False)
    # Of a union's members, the one of the value's type says what is wrong with it (a lone
    # surrogate in a list of strings, not "not a string").
    values = [e for e in errors if not e["type"].endswith("_type")]
    first = (values or errors or [{}])[0]
    loc = [str(part) for part in first.get("loc", ())]
    # pydantic adds the union member it tried ("str", "list[int]") to the location.
    names = [part for part in loc if not any(c in part for c in "[]") and part not in _TYPES]
    path = ".".join(names)
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden" and names:
        message = _unknown_field_message(names, model)
    return InvalidRequest(f"{path}: {message}" if path else message, names[0] if names else None)


def _unknown_field_message(names: list[str], model: type[BaseModel]) -> str:
    if len(names) == 1:
        table, known = UNSUPPORTED_FIELDS, model.model_fields
    elif names[0] == "messages" and len(names) == 3:
        table, known = UNSUPPORTED_MESSAGE_FIELDS, ChatMessage.model_fields
    else:
        table, known = {}, ()
    field = names[-1]
    if field in table:
        return f"not supported by this server ({table[field].why})"
    takes = f"; this server takes {', '.join(sorted(known))}" if known else ""
    return f"unknown field{takes}"


_TYPES = frozenset({"str", "int", "float", "bool", "list", "dict", "function-after"})
