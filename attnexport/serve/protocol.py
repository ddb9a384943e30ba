"""The OpenAI API's request and response bodies that the server speaks (pydantic models).

Requests are validated strictly (a string is not a number, a float is not an int), unknown
fields are ignored as OpenAI's API does, and what the engine cannot do (``logprobs``,
``echo``, penalties) is refused with a 400 naming the field rather than ignored. Extensions
as in vLLM: ``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    """Ignored beyond the response's ``model``: the server serves one model."""
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    """Default 0 (greedy), like ``attnexport run`` (OpenAI's default is 1)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """Extension: keep the k most likely tokens; 0 or -1 keeps all."""
    n: Annotated[int, Field(ge=1)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: TokenIds | None = None
    """Extension: token ids that end a sample (kept in its tokens), besides the model's EOS."""
    ignore_eos: bool = False
    """Extension: do not stop at the model's end-of-sequence tokens."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """Extension: each choice also carries its ``token_ids`` (and the response the
    ``prompt_token_ids``)."""
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: str
    content: str | list[TextPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` with the text parts joined, for the chat template."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Default: what is left of the model's maximum length after the prompt."""
    logprobs: bool | None = None
    top_logprobs: int | None = None


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[list[int]] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "attnexport"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
