"""The OpenAI API's request and response bodies that the server speaks (pydantic models).

Requests are validated strictly (a string is not a number, a float is not an int) and no field
is ignored: a field the server does not implement is refused with a 400 naming it, as OpenAI
refuses an unknown argument. :data:`UNSUPPORTED_FIELDS` names the fields of OpenAI's API that a
client may send and this server does not do yet, each with the values that ask for nothing
(accepted and dropped: ``"logprobs": false``, ``"tools": []``) and the reason given for the
others; turning one on is adding it to the request model and removing its row (docs/serving.md
mirrors the table). Any other unknown field is refused as unknown. Extensions as in vLLM:
``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``.

Lists are validated fail-fast (the first bad item is the error), so a body of a million bad ids
costs one error, not a million.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

MAX_STOP_TOKEN_IDS = 1024
"""``stop_token_ids`` per request: every end-of-turn token of any vocabulary fits, and the
engine's per-token check stays O(1) (it holds them as a set)."""
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
"""A stop string holds back up to its length - 1 characters of the stream, and each new delta
is searched for every stop string: these bound that work per token (OpenAI takes 4 strings)."""


@dataclass(frozen=True)
class Unsupported:
    """A field of OpenAI's API this server does not do."""

    neutral: tuple
    """Values that ask for nothing (same type and value): accepted and dropped."""
    why: str


UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    # sampling the engine does not do
    "logprobs": Unsupported((None, False), "the sampler keeps no log-probabilities"),
    "top_logprobs": Unsupported((None, 0), "the sampler keeps no log-probabilities"),
    "presence_penalty": Unsupported((None, 0, 0.0), "the sampler applies no penalties"),
    "frequency_penalty": Unsupported((None, 0, 0.0), "the sampler applies no penalties"),
    "repetition_penalty": Unsupported((None, 1, 1.0), "the sampler applies no penalties"),
    "logit_bias": Unsupported((None, {}), "the sampler applies no logit bias"),
    "min_p": Unsupported((None, 0, 0.0), "the sampler has no min-p filter"),
    "min_tokens": Unsupported((None, 0), "samples may end before any minimum length"),
    "response_format": Unsupported(
        (None, {"type": "text"}), "there is no constrained (JSON, schema) decoding"
    ),
    # completions
    "echo": Unsupported((None, False), "the prompt is not returned"),
    "best_of": Unsupported((None, 1), "use n"),
    "suffix": Unsupported((None, ""), "there is no insertion (fill-in-the-middle)"),
    # chat
    "tools": Unsupported((None, []), "there is no tool calling"),
    "tool_choice": Unsupported((None, "none"), "there is no tool calling"),
    "parallel_tool_calls": Unsupported((None,), "there is no tool calling"),
    "functions": Unsupported((None, []), "there is no function calling"),
    "function_call": Unsupported((None, "none"), "there is no function calling"),
    "modalities": Unsupported((None, ["text"]), "the server answers text only"),
    "audio": Unsupported((None,), "the server answers text only"),
    "reasoning_effort": Unsupported((None,), "the server has no reasoning control"),
    # the platform's
    "store": Unsupported((None, False), "nothing is stored"),
    "metadata": Unsupported((None, {}), "nothing is stored"),
    "service_tier": Unsupported((None, "auto", "default"), "there are no service tiers"),
}
"""Request fields of OpenAI's API (and common extensions) this server refuses (400 naming the
field) unless their value is one of the neutral ones."""

UNSUPPORTED_MESSAGE_FIELDS: dict[str, Unsupported] = {
    "name": Unsupported((None,), "the chat template sees only role and content"),
    "tool_calls": Unsupported((None, []), "there is no tool calling"),
    "tool_call_id": Unsupported((None,), "there is no tool calling"),
    "function_call": Unsupported((None,), "there is no function calling"),
    "refusal": Unsupported((None,), "the chat template sees only role and content"),
    "audio": Unsupported((None,), "the server answers text only"),
}
"""The same for the fields of a chat message."""


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return any(type(value) is type(n) and value == n for n in neutral)


def _no_lone_surrogate(text: str) -> str:
    """JSON can carry a lone UTF-16 surrogate (``"\\ud800"``), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"contains a lone surrogate {text[error.start]!r} at index {error.start}, which "
            "is not a character (send valid UTF-16 surrogate pairs)"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_no_lone_surrogate)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(fail_fast=True)]
StopString = Annotated[Text, Field(max_length=MAX_STOP_STRING_CHARS)]


class _Strict(BaseModel):
    """Strict types, and no field ignored: one the model does not declare is refused, after
    the neutral values of ``unsupported_fields`` are dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")
    unsupported_fields: ClassVar[dict[str, Unsupported]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        table = cls.unsupported_fields
        return {
            key: value
            for key, value in data.items()
            if key in cls.model_fields
            or key not in table
            or not _is_neutral(value, table[key].neutral)
        }


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    unsupported_fields = UNSUPPORTED_FIELDS

    model: str | None = None
    """The served model's name (``GET /v1/models``); another name is a 404."""
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    """Default 0 (greedy), like ``attnexport run`` (OpenAI's default is 1)."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    """Extension: keep the k most likely tokens; 0 or -1 keeps all."""
    n: Annotated[int, Field(ge=1)] = 1
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    """Extension: token ids that end a sample (kept in its tokens), besides the model's EOS."""
    ignore_eos: bool = False
    """Extension: do not stop at the model's end-of-sequence tokens."""
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """Extension: each choice also carries its ``token_ids`` (and the response the
    ``prompt_token_ids``)."""
    user: str | None = None
    """Accepted and not used (an end-user id for the caller's own records)."""


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: (
        Text
        | Annotated[list[Text], Field(fail_fast=True)]
        | TokenIds
        | Annotated[list[TokenIds], Field(fail_fast=True)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    unsupported_fields = UNSUPPORTED_MESSAGE_FIELDS

    role: Text
    content: Text | Annotated[list[TextPart], Field(fail_fast=True)] | None = None

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` with the text parts joined, for the chat template."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Default: what is left of the model's maximum length after the prompt."""


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
