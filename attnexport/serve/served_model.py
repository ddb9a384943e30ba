"""The model a server serves: its engine, its tokenizer and the generation defaults of its
artifact (end-of-sequence and forced tokens), loaded as ``attnexport run`` loads them, so a
served completion equals ``run``'s for the same prompt and parameters."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from attnexport.artifact import artifact_dir, read_manifest
from attnexport.errors import UserError
from attnexport.runtime.config import CacheConfig, SchedulerConfig
from attnexport.runtime.engine import Engine, engine_from_path
from attnexport.runtime.loading import artifact_tokenizer
from attnexport.runtime.text import Tokenizer


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

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def load_served_model(
    artifact: str | os.PathLike,
    *,
    name: str | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    max_model_len: int | None = None,
    kv_cache_bytes: int | None = None,
    **executor_options,
) -> ServedModel:
    """Loads ``artifact`` (an export directory, ``model.onnx`` or ``model.pt2``) for serving.

    Args:
        name: the model id of ``/v1/models`` and the responses (default: the export
            directory's name).
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits
            (:class:`~attnexport.runtime.SchedulerConfig`; a None budget is the engine's:
            2048, or a LongRoPE model's switch length + 1).
        kv_cache_bytes: the KV pool's size (default: sized for ``max_num_seqs`` sequences of
            ``max_model_len`` tokens, see :class:`~attnexport.runtime.CacheConfig`).
        executor_options: ``executor``, ``backend``, ``device``, ``num_threads``,
            ``trust_pickle`` (:func:`~attnexport.runtime.loading.load_executor`).

    Raises:
        UserError: a missing artifact, an encoder-only model (nothing to generate), or a chat
            template that does not compile.
    """
    artifact = Path(artifact)
    if not artifact.exists():
        raise UserError(
            f"ARTIFACT: {artifact} does not exist (create one with: attnexport export MODEL "
            "--out DIR)"
        )
    manifest = read_manifest(artifact)
    if manifest and manifest["kind"] == "encoder":
        raise UserError(
            f"ARTIFACT: {manifest['architecture']} is an encoder model; the server generates "
            "with decoder and encoder-decoder models"
        )
    directory = artifact_dir(artifact)
    try:
        tokenizer = artifact_tokenizer(directory, manifest)
    except ModuleNotFoundError:  # no transformers: token-id prompts only, no text returned
        tokenizer = None
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
    )


def _ready(tokenizer: Tokenizer) -> None:
    """Compiles the chat template now (one that does not compile is refused at start-up, not
    at each request), and encodes once: transformers sets the backend tokenizer's padding and
    truncation on its first call, which must not race with the server's worker threads."""
    if tokenizer.has_chat_template:
        tokenizer.chat_template  # noqa: B018 (a cached property: compiles and checks it)
    tokenizer.encode("warm up")
