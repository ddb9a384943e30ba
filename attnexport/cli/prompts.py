"""The requests of ``attnexport run``: ``--prompt-ids``, ``--prompt``, ``--chat`` and
``--prompts-file`` turned into prompt token ids and per-request sampling overrides.

A prompts file holds one JSON object per line (blank lines are skipped)::

    {"prompt": "The capital of France is", "max_tokens": 8}
    {"messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7, "seed": 1}

with any :class:`~attnexport.runtime.SamplingParams` field beside ``prompt`` or ``messages``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from attnexport.cli.errors import CliError
from attnexport.runtime.chat_template import ChatTemplateError
from attnexport.runtime.sampling import SamplingParams
from attnexport.runtime.text import Tokenizer, TokenizerError, check_messages

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass
class PromptSpec:
    """One request before tokenization: text, chat messages or token ids."""

    where: str
    """The flag or file line it came from, for error messages (``--chat 0``, ``FILE:3``)."""
    text: str | None = None
    messages: list[dict] | None = None
    ids: list[int] | None = None
    sampling: dict = field(default_factory=dict)
    """SamplingParams fields that override the command-line flags for this request."""

    def token_ids(self, tokenizer: Tokenizer | None) -> list[int]:
        """The prompt ids: given, encoded, or the chat template applied (add_generation_prompt)."""
        if self.ids is not None:
            return self.ids
        if tokenizer is None:
            raise CliError(f"{self.where}: a text prompt needs the artifact's tokenizer")
        try:
            if self.messages is not None:
                return tokenizer.apply_chat_template(self.messages)
            return tokenizer.encode(self.text)
        except (TokenizerError, ChatTemplateError) as error:
            raise CliError(f"{self.where}: {error}") from None


def chat_messages(message: str, system: str | None) -> list[dict]:
    """A one-turn conversation: the optional system message, then the user's."""
    messages = [{"role": "system", "content": system}] if system is not None else []
    return [*messages, {"role": "user", "content": message}]


def read_prompts_file(path: Path) -> list[PromptSpec]:
    """The requests of a prompts file; CliError naming the file and line for a bad line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"--prompts-file: cannot read {path}: {error}") from None
    specs = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            specs.append(_parse_line(line, f"--prompts-file {path}, line {number}"))
    if not specs:
        raise CliError(f"--prompts-file: {path} has no requests (one JSON object per line)")
    return specs


def _parse_line(line: str, where: str) -> PromptSpec:
    try:
        entry = json.loads(line)
    except json.JSONDecodeError as error:
        raise CliError(f"{where}: not valid JSON ({error.msg}, column {error.colno})") from None
    if not isinstance(entry, dict):
        raise CliError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    if ("prompt" in entry) == ("messages" in entry):
        raise CliError(f"{where}: expected exactly one of 'prompt' (text) or 'messages'")
    unknown = set(entry) - SAMPLING_FIELDS - {"prompt", "messages"}
    if unknown:
        raise CliError(
            f"{where}: unknown field(s) {sorted(unknown)}; expected 'prompt' or 'messages' "
            f"and sampling fields {sorted(SAMPLING_FIELDS)}"
        )
    sampling = {k: v for k, v in entry.items() if k in SAMPLING_FIELDS}
    if isinstance(sampling.get("stop_token_ids"), list):
        sampling["stop_token_ids"] = tuple(sampling["stop_token_ids"])
    try:
        SamplingParams(**sampling).check()
        if "messages" in entry:
            check_messages(entry["messages"])
    except (TypeError, ValueError) as error:
        raise CliError(f"{where}: {error}") from None
    if "prompt" in entry and not isinstance(entry["prompt"], str):
        raise CliError(f"{where}: 'prompt' must be a string, got {entry['prompt']!r}")
    return PromptSpec(where, entry.get("prompt"), entry.get("messages"), sampling=sampling)
