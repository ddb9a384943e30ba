"""Tool calls as a chat template defines them: the format the model writes its calls in, the
grammar that makes it write one (``tool_choice`` ``required`` or a named function), and the
parser that turns its text into OpenAI's ``tool_calls``.

Two formats, told apart by the chat template's source (``--tool-call-parser`` names one):

* ``hermes`` (Qwen 2.5/3, Hermes, SmolLM3 and most templates that render ``tools``): each call
  is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after any text;
* ``llama3_json`` (Llama 3.1-3.3): the answer is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``), several separated by ``; ``.

A template that renders no tools gets the hermes format. With ``tool_choice`` ``required`` or
a named function the sample is constrained to the format, each call's object to the tools'
schemas (an ``anyOf`` of ``{"name": const, "arguments": parameters}``), so every call parses
and its arguments validate. With ``auto`` the model writes freely and calls are parsed out of
its text; a stream holds back text from the first call's opening on (and any tail that could
open one), then sends the calls whole in one delta each.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from attnexport.runtime.structured_output import JSON_OPTIONS, StructuredOutput, strict_schema

FORMATS = ("hermes", "llama3_json")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text of the arguments object."""
    id: str = ""


def detect_format(template_source: str | None) -> str:
    """The tool-call format a chat template asks for (``hermes`` when it states none)."""
    source = template_source or ""
    if "<tool_call>" in source:
        return "hermes"
    if _PYTHON_TAG in source or ('"parameters"' in source and "tools" in source):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_schema(tool: dict, arguments_key: str) -> dict:
    """The JSON schema of one call of ``tool`` (``{"name", "parameters"}`` of a function)."""
    parameters = tool.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool["name"]},
            arguments_key: strict_schema(parameters),
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def call_grammar(functions: list[dict], fmt: str, parallel: bool) -> StructuredOutput:
    """The Lark grammar of an answer made of calls of ``functions`` (at least one; several
    when ``parallel``) in format ``fmt``."""
    key = "arguments" if fmt == "hermes" else "parameters"
    schema = {"x-guidance": JSON_OPTIONS, "anyOf": [call_schema(f, key) for f in functions]}
    body = f"%json {json.dumps(schema)}"
    if fmt == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        call = "call: body"
        start = 'start: call ("; " call)*' if parallel else "start: call"
    return StructuredOutput("lark", "\n".join([start, call, f"body: {body}"]))


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[ParsedCall]]:
    """``text`` as (content before the calls or None, the calls); no calls when the text
    holds none that parse (the whole text is then the content). A last call that does not
    parse (a sample cut by its length) is left out of the others."""
    if fmt == "hermes":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [_call(m.group(1), "arguments") for m in _HERMES_CALL.finditer(text, start)]
        content = text[:start].strip() or None
    else:
        body = text.strip()
        body = body.removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = [_call(part, "parameters") for part in _split_objects(body)]
        content = None
    if calls and calls[-1] is None:
        calls.pop()
    if not calls or any(c is None for c in calls):
        return text, []
    return content, calls


def _call(text: str, key: str) -> ParsedCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False), new_call_id())


def _split_objects(text: str) -> list[str]:
    """The top-level JSON objects of ``obj; obj; ...``."""
    decoder = json.JSONDecoder()
    parts, index = [], 0
    while index < len(text):
        try:
            _, end = decoder.raw_decode(text, index)
        except ValueError:
            return [text]
        parts.append(text[index:end])
        index = end
        while index < len(text) and text[index] in "; \n":
            index += 1
    return parts


class CallStream:
    """A streamed sample that may call tools: passes text on until a call may have begun,
    then keeps the rest for :func:`parse_calls` at the end.

    Args:
        fmt: the tool-call format.
        forced: the sample is constrained to calls (``required`` or a named function):
            nothing is passed on.
    """

    def __init__(self, fmt: str, forced: bool) -> None:
        self.fmt = fmt
        self.held = forced
        self.text = ""
        self._sent = 0

    def push(self, delta: str) -> str:
        """Takes a text delta; returns the content to stream now."""
        self.text += delta
        if self.held:
            return ""
        if self.fmt == "hermes":
            start = self.text.find("<tool_call>", self._sent)
            if start >= 0:
                self.held = True
                return self._send(start)
            return self._send(len(self.text) - _open_tail(self.text, "<tool_call>"))
        stripped = self.text.lstrip()
        if not stripped:
            return ""
        opens = stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(stripped)
        if opens and self._sent == 0:
            self.held = True
            return ""
        return self._send(len(self.text))

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The content still to stream and the calls, once the sample ended."""
        content, calls = parse_calls(self.text, self.fmt)
        if not calls:
            return self._send(len(self.text)), []
        if content is None or self._sent >= len(content):
            return "", calls
        return content[self._sent :], calls

    def _send(self, end: int) -> str:
        out = self.text[self._sent : end]
        self._sent = max(self._sent, end)
        return out


def _open_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
