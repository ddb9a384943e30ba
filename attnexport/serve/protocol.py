"""The OpenAI API's request and response bodies that the server speaks (pydantic models).

Requests are validated strictly (a string is not a number, a float is not an int) and no field
is ignored: a field the server does not implement is refused with a 400 naming it, as OpenAI
refuses an unknown argument. :data:`UNSUPPORTED_FIELDS` names the fields of OpenAI's API that a
client may send and this server does not do yet, each with the values that ask for nothing
(accepted and dropped: ``"logprobs": false``, ``"tools": []``) and the reason given for the
others; turning one on is adding it to the request model and removing its row (docs/serving.md
mirrors the table). Any other unknown field is refused as unknown. Extensions as in vLLM:
``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``, ``repetition_penalty``,
``min_tokens``, ``prompt_logprobs``.

Lists are validated fail-fast (the first bad item is the error), so a body of a million bad ids
costs one error, not a million.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from attnexport.runtime.logprobs import MAX_LOGPROBS

MAX_TOOLS = 128
"""Tools (and tool calls of a message) per request."""
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
    "min_p": Unsupported((None, 0, 0.0), "the sampler has no min-p filter"),
    # completions
    "best_of": Unsupported((None, 1), "use n"),
    "suffix": Unsupported((None, ""), "there is no insertion (fill-in-the-middle)"),
    # chat
    "functions": Unsupported(
        (None, []), "OpenAI's deprecated function calling: use tools and tool_choice"
    ),
    "function_call": Unsupported(
        (None, "none"), "OpenAI's deprecated function calling: use tools and tool_choice"
    ),
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
    "function_call": Unsupported((None,), "OpenAI's deprecated function calling: use tool_calls"),
    "refusal": Unsupported((None,), "the chat template sees only role, content and tools"),
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
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
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


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: Text | None = None
    schema_: Annotated[dict, Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None
    """Accepted: the schema is always enforced (OpenAI's strict mode)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


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
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    """Extension (vLLM's): divides the positive logits of prompt and output tokens,
    multiplies the negative ones (1: off)."""
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    """Token id (as a string, OpenAI's keys) -> value added to its logit."""
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    """Extension: the stop tokens are banned until a sample has this many tokens."""
    prompt_logprobs: TopLogprobs | None = None
    """Extension (vLLM's): the log-probability of every prompt token (and its row's this
    many most likely tokens)."""
    response_format: ResponseFormat | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: (
        Text
        | Annotated[list[Text], Field(fail_fast=True)]
        | TokenIds
        | Annotated[list[TokenIds], Field(fail_fast=True)]
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: TopLogprobs | None = None
    """The log-probability of each generated token and its row's this many most likely
    tokens (OpenAI's legacy shape)."""
    echo: bool = False
    """The prompt is returned before the generated text (and, with ``logprobs``, the prompt
    tokens' log-probabilities: a prompt's score)."""


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Text
    arguments: Text
    """The arguments as JSON text (OpenAI's shape)."""


class ToolCall(_Strict):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    unsupported_fields = UNSUPPORTED_MESSAGE_FIELDS

    role: Text
    content: Text | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    """An assistant turn's calls, given back to the template (arguments parsed from JSON, as
    chat templates expect a mapping)."""
    tool_call_id: Text | None = None
    """A ``tool`` turn: the call it answers."""

    def as_template_message(self) -> dict:
        """``{"role", "content"}`` with the text parts joined (and the tool fields that are
        set), for the chat template."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        return message


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments (None: an object of any properties)."""
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Text


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """Default: what is left of the model's maximum length after the prompt."""
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    """With ``logprobs``: each token's row's this many most likely tokens."""
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Default ``auto`` with tools, ``none`` without."""
    parallel_tool_calls: bool = True


# ---------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions shape: one entry per token in each list."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry of one token."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class _Reply(BaseModel):
    """The fields that open every completion, chat completion and chunk of a stream, in
    OpenAI's order (a subclass sets ``object`` and adds ``choices``, ``usage``, ...)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None


class CompletionResponse(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None
    prompt_token_ids: list[list[int]] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(_Reply):
    object: Literal["text_completion"] = "text_completion"
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


class ModelRequest(_Strict):
    model: str | None = None


class TokenizeRequest(ModelRequest):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` (rendered by the chat
    template, with ``tools``)."""

    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)] | None = None
    add_special_tokens: bool | None = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(ModelRequest):
    tokens: TokenIds


class DetokenizeResponse(BaseModel):
    prompt: str


MAX_EMBEDDING_INPUTS = 2048
"""Inputs per ``/v1/embeddings`` request (OpenAI's limit)."""


class EmbeddingRequest(ModelRequest):
    """OpenAI's ``POST /v1/embeddings``."""

    input: (
        Text
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[TokenIds, Field(min_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    """``base64``: the float32 vector's little-endian bytes, base64-encoded."""
    dimensions: Annotated[int, Field(ge=1)] | None = None
    """Accepted when it is the model's dimension (nothing is truncated)."""
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
