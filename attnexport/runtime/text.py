"""Text in, text out: the artifact's tokenizer, exactly as ``transformers.AutoTokenizer``.

Encoding is ``AutoTokenizer(text, add_special_tokens=True)`` with padding and truncation off
(a ``tokenizer.json`` may configure both; all-MiniLM's pads every prompt to 128 tokens), and
decoding is ``tokenizer.decode(ids, skip_special_tokens=True)``. Transformers' tokenizer classes
import without torch, so this module (used by the CLI and by :class:`Engine`) needs only
``transformers`` and ``tokenizers``, and never imports torch itself. Nothing outside the
tokenizer's directory is read (:mod:`attnexport.contained_files`).

:class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas whose
concatenation is always the full decode and which never end in a half-decoded character.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING

from attnexport.contained_files import (
    RULE,
    UnsafePathError,
    check_entries,
    contained_file,
    read_json,
)
from attnexport.errors import UserError, require

if TYPE_CHECKING:
    from attnexport.runtime.chat_template import ChatTemplate, TemplateLimits

REPLACEMENT_CHARACTER = "\ufffd"


def _no_torch_advice(record: logging.LogRecord) -> bool:
    """Drops the warning transformers logs on import without torch (a deployment install):
    "PyTorch was not found. Models won't be available": only its tokenizers are used here."""
    return "PyTorch was not found" not in record.getMessage()


class TokenizerError(UserError):
    """A tokenizer that is missing or cannot do what was asked (no chat template, bad
    messages); the message names the directory or argument."""


class Tokenizer:
    """The tokenizer of an export directory (or any Hugging Face tokenizer directory).

    Args:
        hf_tokenizer: a ``transformers`` tokenizer (what ``AutoTokenizer.from_pretrained``
            returns).
        source: where it was loaded from, for error messages.
    """

    def __init__(self, hf_tokenizer, source: str = "the tokenizer") -> None:
        self.hf = hf_tokenizer
        self.source = source

    @classmethod
    def from_directory(cls, directory: str | os.PathLike) -> Tokenizer:
        """``AutoTokenizer.from_pretrained(directory)``, reading nothing outside the directory.

        transformers opens the files itself, so the directory is checked first: none of its
        entries (nor those of ``additional_chat_templates/``) may be a link or a special file,
        and a ``*_file`` argument of ``tokenizer_config.json`` (older transformers open the
        path it holds; old configs hold stale absolute paths) is given as the file of that
        name in the directory, or None.

        Raises:
            TokenizerError: no tokenizer files, or files transformers cannot read.
            UnsafePathError: an entry that is a link or not a regular file.
            MissingDependencyError: transformers is not installed (names the extra).
        """
        directory = Path(directory)
        overrides = _contained_file_arguments(directory)
        transformers_logger = logging.getLogger("transformers")
        transformers_logger.addFilter(_no_torch_advice)
        try:
            transformers = require("transformers", "hf", "text prompts (the artifact's tokenizer)")
        finally:
            transformers_logger.removeFilter(_no_torch_advice)
        try:
            hf = transformers.AutoTokenizer.from_pretrained(str(directory), **overrides)
        except (OSError, ValueError, RecursionError) as error:
            raise TokenizerError(
                f"{directory}: cannot load its tokenizer with transformers.AutoTokenizer: "
                f"{' '.join(str(error).split())}"
            ) from None
        return cls(hf, str(directory))

    def encode(self, text: str) -> list[int]:
        """``text`` -> token ids, special tokens as the tokenizer config says; never padded or
        truncated (a prompt longer than the model is the engine's named error, not a cut)."""
        if not isinstance(text, str):
            raise TokenizerError(f"prompt: expected a string, got {type(text).__name__}")
        return list(
            self.hf(text, add_special_tokens=True, padding=False, truncation=False)["input_ids"]
        )

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text, special tokens skipped (``tokenizer.decode(ids,
        skip_special_tokens=True)``)."""
        return self.hf.decode(list(ids), skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @functools.cached_property
    def chat_template(self) -> ChatTemplate:
        """The tokenizer's chat template, compiled once in attnexport's bounded sandbox
        (:mod:`attnexport.runtime.chat_template`). TokenizerError when there is none or it
        does not compile."""
        from attnexport.runtime.chat_template import ChatTemplate

        if not self.has_chat_template:
            raise TokenizerError(
                f"{self.source}: this tokenizer has no chat template (tokenizer_config.json "
                "has no 'chat_template' and there is no chat_template.jinja); give the "
                "conversation as a plain text prompt instead"
            )
        return ChatTemplate(self.hf.get_chat_template())

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        limits: TemplateLimits | None = None,
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Chat messages (``[{"role": "user", "content": "..."}, ...]``) -> prompt ids, with
        the assistant's generation prompt appended: what transformers'
        ``apply_chat_template(messages, tools=tools, add_generation_prompt=True)`` returns
        (``tools``: OpenAI's ``{"type": "function", "function": {...}}`` objects, as
        transformers passes them to the template), rendered within ``limits`` (default
        :class:`~attnexport.runtime.chat_template.TemplateLimits`).

        Raises:
            TokenizerError: no chat template, or malformed messages.
            ChatTemplateError: the template does not compile, failed, or went past ``limits``
                (:class:`~attnexport.runtime.chat_template.TemplateLimitError`).
        """
        from attnexport.runtime.chat_template import TemplateLimits

        template = self.chat_template
        check_messages(messages)
        text = template.render(
            limits or TemplateLimits(),
            messages=[dict(message) for message in messages],
            tools=[dict(tool) for tool in tools] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.hf.special_tokens_map,
        )
        encoded = self.hf(text, add_special_tokens=False, padding=False, truncation=False)
        return list(encoded["input_ids"])

    @functools.cached_property
    def cleans_up_spaces(self) -> bool:
        """Whether decoding removes spaces before punctuation (so streamed text must hold the
        last word back)."""
        if getattr(self.hf, "clean_up_tokenization_spaces", False):
            return True
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return False
        decoder = json.loads(backend.to_str()).get("decoder")
        return '"cleanup": true' in json.dumps(decoder)

    @functools.cached_property
    def byte_run_ids(self) -> frozenset[int]:
        """The tokens a byte-fallback run is made of (empty for other vocabularies): the
        ``<0xNN>`` pieces, and the special tokens, which decoding skips, so they do not end a
        run. A run decodes as one UTF-8 string, all U+FFFD if any byte is invalid, so streamed
        text must hold a trailing run back."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or not json.loads(backend.to_str())["model"].get("byte_fallback"):
            return frozenset()
        return frozenset(
            i for token, i in self.hf.get_vocab().items() if _BYTE_TOKEN.fullmatch(token)
        ) | frozenset(self.hf.all_special_ids)

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one generated sequence."""
        return IncrementalDetokenizer(self)


CHAT_TEMPLATES_DIR = "additional_chat_templates"
"""Where a tokenizer directory keeps named chat templates (``NAME.jinja``)."""


def _contained_file_arguments(directory: Path) -> dict[str, str | None]:
    """Checks the files transformers may open in ``directory``; returns, for each ``*_file``
    key of its ``tokenizer_config.json``, the file of that name in the directory (None when
    there is none) for ``from_pretrained`` to take instead of the path the key holds."""
    check_entries(directory, (CHAT_TEMPLATES_DIR,))
    config_file = contained_file(directory, "tokenizer_config.json")
    if not config_file.is_file():
        return {}
    config = read_json(config_file, TokenizerError)
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: expected a JSON object")
    names = config.get("fast_tokenizer_files", [])
    if not isinstance(names, list) or any(
        not isinstance(n, str) or PurePath(n).name != n for n in names
    ):
        raise UnsafePathError(
            f"{config_file}: field 'fast_tokenizer_files': expected file names of the "
            f"directory, got {names!r}; {RULE}"
        )
    overrides = {}
    for key, value in config.items():
        if key.endswith("_file") and isinstance(value, str):
            name = PurePath(value).name
            path = contained_file(directory, name) if name else None
            overrides[key] = str(path) if path is not None and path.is_file() else None
    return overrides


def check_messages(messages: object, what: str = "messages") -> None:
    """TokenizerError naming ``what`` unless ``messages`` is a non-empty list of
    ``{"role": str, "content": str}`` objects."""
    if not isinstance(messages, list) or not messages:
        raise TokenizerError(f"{what}: expected a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise TokenizerError(
                f"{what}[{i}]: expected an object with string 'role' and 'content', got {message!r}"
            )


class IncrementalDetokenizer:
    """Text deltas of a growing token sequence.

    Each call decodes the whole sequence, so the text always equals ``decode(ids)`` (a windowed
    decode like vLLM's prefix/read offsets can differ from it where the tokenizer cleans up
    spaces before punctuation), and emits only the part later tokens cannot change: never a
    trailing U+FFFD (a multi-byte character whose remaining bytes are not generated yet), nor
    the text of a trailing run of byte-fallback tokens (one invalid byte turns the whole run
    into U+FFFD), nor, when the tokenizer cleans up spaces (``clean_up_tokenization_spaces`` or
    a WordPiece decoder with ``cleanup``), anything from the last whitespace on (cleanup
    removes a space only once the text after it is known). :meth:`finish` emits the rest, so
    the concatenation of all deltas is the full decode.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        self._hold_last_word = tokenizer.cleans_up_spaces
        self._byte_run = tokenizer.byte_run_ids

    @property
    def text(self) -> str:
        """The full decode of the tokens so far."""
        return self.tokenizer.decode(self.ids)

    def push(self, new_ids: Sequence[int]) -> str:
        """Adds generated tokens; returns the text that became final (maybe empty)."""
        if not new_ids:
            return ""
        self.ids.extend(new_ids)
        text = self.text
        end = len(text.rstrip(REPLACEMENT_CHARACTER))
        if self._hold_last_word:
            end = max(text.rfind(space, 0, end) for space in _WHITESPACE)
        run = len(self.ids)
        while run and self.ids[run - 1] in self._byte_run:
            run -= 1
        if run < len(self.ids):
            end = min(end, len(self.tokenizer.decode(self.ids[:run])))
        return self._emit(text, end)

    def finish(self) -> str:
        """The text not emitted yet; call once, when the sequence is finished."""
        text = self.text
        return self._emit(text, len(text))

    def _emit(self, text: str, end: int) -> str:
        if end <= len(self.emitted):
            return ""
        if not text.startswith(self.emitted):  # cannot happen with the holds above
            raise RuntimeError(
                f"incremental detokenization diverged: emitted {self.emitted!r}, "
                f"now decoding {text!r}"
            )
        delta = text[len(self.emitted) : end]
        self.emitted += delta
        return delta


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_WHITESPACE = (" ", "\n", "\t", "\r")
