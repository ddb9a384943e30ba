"""The model a server serves: its engine, its tokenizer and the generation defaults of its
artifact (end-of-sequence and forced tokens), loaded as ``attnexport run`` loads them, so a
served completion equals ``run``'s for the same prompt and parameters."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from attnexport.artifact import artifact_dir, read_manifest
from attnexport.errors import UserError
from attnexport.runtime.config import CacheConfig, SchedulerConfig
from attnexport.runtime.embedding import EmbeddingEngine
from attnexport.runtime.engine import Engine, engine_from_path
from attnexport.runtime.loading import artifact_tokenizer
from attnexport.runtime.structured_output import CompiledGrammar, GrammarCompiler, StructuredOutput
from attnexport.runtime.text import Tokenizer
from attnexport.serve.tool_calls import FORMATS, detect_format


@dataclass
class ServedModel:
    """What the server needs of a model. The engine has no tokenizer: the server decodes on
    its event loop, so the driver thread never waits for text."""

    name: str
    engine: Engine
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...] = ()
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    tool_call_format: str = "hermes"
    """How the model writes tool calls (:mod:`attnexport.serve.tool_calls`)."""
    _grammars: GrammarCompiler | None = field(default=None, repr=False)
    _grammar_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def compile_grammar(self, spec: StructuredOutput) -> CompiledGrammar:
        """``spec`` compiled (cached) for this model's tokenizer, the compiler made on first
        use (llguidance reads the vocabulary once: a second or two) and handed to the engine.
        UserError when the model has no tokenizer or the grammar does not compile."""
        with self._grammar_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise UserError(
                        f"the model {self.name!r} has no tokenizer, so its output cannot be "
                        "constrained (response_format, tools)"
                    )
                self._grammars = GrammarCompiler(
                    self.tokenizer.hf, self.engine.executor.vocab_size, self.eos_token_ids
                )
                self.engine.grammars = self._grammars
        return self._grammars.compile(spec)


def load_served_model(
    artifact: str | os.PathLike,
    *,
    name: str | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    chat_template: str | None = None,
    tool_call_format: str | None = None,
    **executor_options,
) -> ServedModel | ServedEncoder:
    """Loads ``artifact`` (an export directory, ``model.onnx`` or ``model.pt2``) for serving.

    Args:
        name: the model id of ``/v1/models`` and the responses (default: the export
            directory's name).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits
            (:class:`~attnexport.runtime.SchedulerConfig`; a None budget is the engine's:
            2048, or a LongRoPE model's switch length + 1).
        kv_cache_bytes: the KV pool's size (default: sized for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, see :class:`~attnexport.runtime.CacheConfig`).
        chat_template: a Jinja chat template replacing the artifact's (vLLM's and
            llama-server's ``--chat-template``), e.g. one that renders ``tools``.
        tool_call_format: ``hermes`` or ``llama3_json`` (default: what the chat template
            asks for, :func:`~attnexport.serve.tool_calls.detect_format`).
        executor_options: ``executor``, ``backend``, ``device``, ``num_threads``,
            ``trust_pickle`` (:func:`~attnexport.runtime.loading.load_executor`).

    Returns:
        a :class:`ServedModel`, or a :class:`ServedEncoder` for an encoder artifact (served
        for its embeddings).

    Raises:
        UserError: a missing artifact, or a chat template that does not compile.
    """
    artifact = Path(artifact)
    if not artifact.exists():
        raise UserError(
            f"ARTIFACT: {artifact} does not exist (create one with: attnexport export MODEL "
            "--out DIR)"
        )
    manifest = read_manifest(artifact)
    directory = artifact_dir(artifact)
    try:
        tokenizer = artifact_tokenizer(directory, manifest)
    except ModuleNotFoundError:  # no transformers: token-id prompts only, no text returned
        tokenizer = None
    if manifest and manifest["kind"] == "encoder":
        return _served_encoder(artifact, manifest, name or directory.resolve().name, tokenizer)
    if chat_template is not None:
        if tokenizer is None:
            raise UserError("--chat-template: the artifact has no tokenizer to render it with")
        tokenizer.hf.chat_template = chat_template
    if tool_call_format is not None and tool_call_format not in FORMATS:
        raise UserError(f"tool_call_format: expected one of {FORMATS}, got {tool_call_format!r}")
    if tokenizer is not None:
        _ready(tokenizer)
    engine = engine_from_path(
        artifact,
        cache_config=CacheConfig(memory_bytes=kv_cache_bytes),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
        ),
        **executor_options,
    )
    generation = (manifest or {}).get("generation") or {}
    return ServedModel(
        name=name or directory.resolve().name,
        engine=engine,
        tokenizer=tokenizer,
        eos_token_ids=tuple(generation.get("eos_token_ids", [])),
        forced_bos_token_id=generation.get("forced_bos_token_id"),
        forced_eos_token_id=generation.get("forced_eos_token_id"),
        tool_call_format=tool_call_format or detect_format(_template_source(tokenizer)),
    )


def _template_source(tokenizer: Tokenizer | None) -> str | None:
    if tokenizer is None or not tokenizer.has_chat_template:
        return None
    return tokenizer.hf.get_chat_template()


@dataclass
class ServedEncoder:
    """An encoder artifact served for its embeddings (``/v1/embeddings``)."""

    name: str
    embedder: EmbeddingEngine
    tokenizer: Tokenizer | None
    max_model_len: int


def _served_encoder(artifact: Path, manifest: dict, name: str, tokenizer) -> ServedEncoder:
    embedder = EmbeddingEngine.from_path(artifact)
    limit = embedder.config.max_seq_length or embedder.executor.max_model_len or 512
    return ServedEncoder(name, embedder, tokenizer, limit)


def _ready(tokenizer: Tokenizer) -> None:
    """Compiles the chat template now (one that does not compile is refused at start-up, not
    at each request), and encodes once: transformers sets the backend tokenizer's padding and
    truncation on its first call, which must not race with the server's worker threads."""
    if tokenizer.has_chat_template:
        tokenizer.chat_template  # noqa: B018 (a cached property: compiles and checks it)
    tokenizer.encode("warm up")
