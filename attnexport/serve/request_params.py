"""The request fields that become the engine's sampling extras: log-probabilities, penalties,
``logit_bias``, ``min_tokens``, and the grammar of ``response_format`` or of ``tools`` with
``tool_choice`` ``required`` or a named function. Each bad value is a 400 naming its field,
found in the request's worker thread (a grammar is compiled there too, so the engine's
thread only copies it)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from attnexport.errors import UserError
from attnexport.runtime.structured_output import StructuredOutput
from attnexport.serve.errors import InvalidRequest
from attnexport.serve.protocol import ChatCompletionRequest, CompletionRequest
from attnexport.serve.served_model import ServedModel
from attnexport.serve.tool_calls import call_grammar


@dataclass(frozen=True)
class ToolUse:
    """How a chat request's answer is read for tool calls."""

    format: str
    forced: bool
    """``tool_choice`` ``required`` or a named function: the answer is calls only."""


def sampling_extras(
    body: CompletionRequest | ChatCompletionRequest, model: ServedModel
) -> tuple[dict, ToolUse | None]:
    """The :class:`~attnexport.runtime.sampling.SamplingParams` keywords of the request's
    log-probability, penalty, bias and grammar fields, and how to read tool calls (None
    when the request has no tools or ``tool_choice`` is ``none``)."""
    extras: dict = {}
    if isinstance(body, CompletionRequest):
        extras["logprobs"] = body.logprobs
        prompt = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            prompt = max(body.logprobs, prompt or 0)
        extras["prompt_logprobs"] = prompt
    else:
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs: true", "top_logprobs")
        extras["logprobs"] = (body.top_logprobs or 0) if body.logprobs else None
        extras["prompt_logprobs"] = body.prompt_logprobs
    for name, default in (
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("repetition_penalty", 1.0),
    ):
        value = getattr(body, name)
        extras[name] = default if value is None else float(value)
    extras["min_tokens"] = body.min_tokens or 0
    if body.logit_bias:
        extras["logit_bias"] = _logit_bias(body.logit_bias)
    spec, param, tools = _grammar(body, model)
    if spec is not None:
        try:
            model.compile_grammar(spec)
        except UserError as error:
            raise InvalidRequest(f"{param}: {error}", param) from None
        extras["structured"] = spec
    return extras, tools


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise InvalidRequest(
                f"logit_bias: keys are token ids (strings of digits), got {key!r}", "logit_bias"
            )
        out[int(key)] = float(value)
    return out


def _grammar(body, model: ServedModel) -> tuple[StructuredOutput | None, str, ToolUse | None]:
    """The request's grammar (with the field to blame for it) and its tool use."""
    spec = None
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            spec = StructuredOutput("json_object")
        else:
            if response_format.json_schema is None:
                raise InvalidRequest(
                    "response_format: type json_schema needs a json_schema object",
                    "response_format",
                )
            schema = json.dumps(response_format.json_schema.schema_)
            spec = StructuredOutput("json_schema", schema)
    if not isinstance(body, ChatCompletionRequest):
        return spec, "response_format", None
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice: needs tools", "tool_choice")
        return spec, "response_format", None
    if choice == "none":
        return spec, "response_format", None
    functions = [tool.function.model_dump(exclude_none=True) for tool in body.tools]
    if choice in (None, "auto"):
        return spec, "response_format", ToolUse(model.tool_call_format, forced=False)
    if choice != "required":
        functions = [f for f in functions if f["name"] == choice.function.name]
        if not functions:
            raise InvalidRequest(
                f"tool_choice: no tool is named {choice.function.name!r}", "tool_choice"
            )
    if spec is not None:
        raise InvalidRequest(
            "response_format: cannot be combined with a tool_choice that forces a call",
            "response_format",
        )
    parallel = body.parallel_tool_calls and choice == "required"  # a named one: one call
    grammar = call_grammar(functions, model.tool_call_format, parallel)
    return grammar, "tools", ToolUse(model.tool_call_format, forced=True)
