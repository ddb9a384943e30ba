"""OpenAI-shaped errors: every failure is ``{"error": {"message", "type", "param", "code"}}``
with its HTTP status; a bad request is a 400, never a 500 or a dropped connection."""

from __future__ import annotations

import re

from attnexport.errors import UserError
from attnexport.serve.protocol import ErrorInfo, ErrorResponse

_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\[\d+\])?: ")


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()


class InvalidRequest(APIError, UserError):
    """A 400: the request is malformed or asks for what the model cannot do."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(400, message, "invalid_request_error", param or field_of(message))


def field_of(message: str) -> str | None:
    """The field an attnexport error message names (``"prompt: token id ..."`` -> ``prompt``)."""
    match = _FIELD.match(message)
    return match.group(1) if match else None


def model_not_found(name: str, served: str) -> APIError:
    """OpenAI's 404 for a model it does not serve."""
    return APIError(
        404,
        f"The model `{name}` does not exist: this server serves `{served}` (GET /v1/models)",
        "invalid_request_error",
        code="model_not_found",
    )


def server_error(message: str) -> APIError:
    return APIError(500, message, "server_error")


def unavailable(message: str, code: str = "server_overloaded") -> APIError:
    """A 503: the server is at capacity or shutting down; clients should retry later."""
    return APIError(503, message, "service_unavailable", code=code)
