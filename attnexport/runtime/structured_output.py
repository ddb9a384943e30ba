"""Constrained decoding: a sample that must match a JSON schema, any JSON object, a Lark
grammar or a regular expression, through llguidance (the grammar library vLLM and llama.cpp
use; chosen over xgrammar by ``benchmarks/grammar_mask.py``: no torch, a NumPy API, and
millisecond grammar compiles where xgrammar took seconds on a schema with a ``format``;
docs/benchmarks.md).

    compiler = GrammarCompiler(hf_tokenizer, vocab_size=49152, eos_token_ids=[2])
    grammar = compiler.compile(StructuredOutput("json_schema", json.dumps(schema)))
    matcher = grammar.matcher()                       # one per sample
    fill_bitmasks([matcher], bitmask)                 # before sampling: allowed tokens
    apply_bitmasks(logits_rows, bitmask)              # forbidden tokens -> -inf
    matcher.accept(token)                             # after sampling

A grammar is compiled once per distinct request spec (a small LRU cache, thread-safe: the
server compiles in its request threads, so the engine's thread only copies a matcher). JSON
schemas are compiled as vLLM's and xgrammar's strict modes read them: an object schema with
``properties`` and no ``additionalProperties`` takes no other property; whitespace is Python's
``json.dumps`` (``", "`` and ``": "``, nothing else), so a small model cannot spend its tokens
on blank space. A schema keyword llguidance does not implement is refused (UserError naming
it), never ignored.

llguidance is an optional dependency (the ``structured`` extra): this module imports it only
when a compiler is made.
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from attnexport.errors import UserError, require

KINDS = ("json_schema", "json_object", "lark", "regex")
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON compiler options: Python's ``json.dumps`` separators, no other space."""
CACHE_SIZE = 256
"""Compiled grammars kept (by spec)."""


class GrammarError(UserError):
    """A schema or grammar that cannot be compiled; the message says why."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a sample's text must match.

    ``kind``: ``json_schema`` (``value`` is the schema as JSON text), ``json_object`` (any
    JSON object; ``value`` unused), ``lark`` (an llguidance Lark grammar, which may embed JSON
    schemas with ``%json``), ``regex``."""

    kind: Literal["json_schema", "json_object", "lark", "regex"]
    value: str = ""

    def check(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"structured output: expected a kind in {KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise UserError("structured output: expected the schema or grammar as a string")


def strict_schema(schema):
    """``schema`` (parsed JSON) with ``additionalProperties: false`` on every object schema
    that lists ``properties`` and says nothing of others (a copy; vLLM's and xgrammar's
    strict reading)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (not yet checked)."""
    import llguidance

    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=JSON_OPTIONS
        )
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as error:
            raise GrammarError(f"json_schema: not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("json_schema: expected a JSON object (a schema)")
        return llguidance.LLMatcher.grammar_from_json_schema(
            strict_schema(schema), defaults=JSON_OPTIONS
        )
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.value)
    return llguidance.LLMatcher.grammar_from_regex(spec.value)


class GrammarMatcher:
    """One sample's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher) -> None:
        self._matcher = matcher

    def accept(self, token: int) -> None:
        """Advances past ``token``; raises RuntimeError if the grammar forbids it."""
        if not self._matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self._matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and takes nothing more (its end-of-sequence was taken)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (it then allows no token), else None."""
        if not self._matcher.is_error():
            return None
        return self._matcher.get_error() or "unknown error"


class CompiledGrammar:
    """A checked grammar: makes the matchers of the samples that follow it."""

    def __init__(self, tokenizer, grammar: str) -> None:
        import llguidance

        self._template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self._template.is_error():
            raise GrammarError(self._template.get_error())

    def matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start (a copy of the compiled one: ~50 us, where
        building it again takes milliseconds)."""
        return GrammarMatcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles request specs against one tokenizer, caching the results by spec.

    Args:
        hf_tokenizer: the artifact's ``transformers`` fast tokenizer.
        vocab_size: the model's logits width (the bitmask covers it; ids past the tokenizer
            are never allowed).
        eos_token_ids: the tokens that end a sample: a complete grammar allows only these.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        require("llguidance", "structured", "structured output (response_format, tools)")
        import llguidance.hf

        eos = [int(t) for t in eos_token_ids] or None
        self.tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=eos
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[StructuredOutput, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of ``spec``; GrammarError (a UserError) if it does not
        compile."""
        with self._lock:
            grammar = self._cache.get(spec)
            if grammar is not None:
                self._cache.move_to_end(spec)
                return grammar
        spec.check()
        try:
            grammar = CompiledGrammar(self.tokenizer, grammar_text(spec))
        except GrammarError:
            raise
        except ValueError as error:
            raise GrammarError(f"{spec.kind}: {error}") from None
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


def bitmask_for(rows: int, vocab_size: int) -> np.ndarray:
    """A zeroed ``[rows, ceil(vocab_size / 32)]`` int32 bitmask (nothing allowed)."""
    return np.zeros((rows, (vocab_size + 31) // 32), dtype=np.int32)


def fill_bitmasks(matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> None:
    """Row i of ``bitmask`` gets the tokens ``matchers[i]`` allows next (bit set = allowed)."""
    import llguidance.numpy

    for i, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher._matcher, bitmask, i)


def apply_bitmasks(rows: np.ndarray, bitmask: np.ndarray) -> None:
    """Sets to -inf, in place, the logits of ``rows`` ``[R, vocab]`` whose bit in
    ``bitmask`` ``[R, ceil(vocab / 32)]`` is clear."""
    vocab = rows.shape[-1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    np.copyto(rows, -np.inf, where=allowed == 0)
