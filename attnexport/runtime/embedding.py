"""Sentence embeddings from encoder models (BERT): packed variable-length batches through an
encoder executor, then pooling and normalisation as the checkpoint's sentence-transformers
configuration says (the export manifest's ``embedding`` entry).

Torch-free, like the rest of the serving core: :class:`OrtEncoderExecutor` runs the ONNX file,
``TorchEncoderExecutor`` (:mod:`attnexport.runtime.executors.torch_encoder_executor`) the
module or ``.pt2``.

    from attnexport.runtime.embedding import EmbeddingEngine
    engine = EmbeddingEngine.from_path("out/")         # an encoder export directory
    vectors = engine.embed_texts(["A man is eating food."])   # [1, hidden] float32
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from attnexport.errors import UserError
from attnexport.model_interface import ENCODER_INPUT_NAMES

POOLING_MODES = ("mean", "cls")


class EmbeddingInputError(UserError):
    """Sequences an encoder cannot embed (empty, ids out of the vocabulary, too long); the
    message names the argument and the sequence."""


@dataclass(frozen=True)
class EmbeddingConfig:
    """How hidden states become one vector per sequence."""

    pooling: str = "mean"
    """``mean`` (the average over the sequence's tokens) or ``cls`` (its first token)."""
    normalize: bool = False
    """L2-normalise each vector (sentence-transformers' ``Normalize`` module)."""
    max_seq_length: int | None = None
    """Texts are truncated to this many tokens, special tokens included
    (sentence-transformers' ``max_seq_length``); None: the model's limit."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise UserError(f"pooling: expected one of {POOLING_MODES}, got {self.pooling!r}")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise UserError(f"max_seq_length: expected a positive int, got {self.max_seq_length}")

    @classmethod
    def from_manifest(cls, manifest: dict | None) -> EmbeddingConfig:
        """The manifest's ``embedding`` entry (the defaults when absent)."""
        entry = (manifest or {}).get("embedding") or {}
        if not isinstance(entry, dict):
            raise UserError(f"manifest 'embedding': expected an object, got {entry!r}")
        return cls(
            pooling=entry.get("pooling", "mean"),
            normalize=bool(entry.get("normalize", False)),
            max_seq_length=entry.get("max_seq_length"),
        )


class EncoderExecutor(Protocol):
    """Runs an encoder forward (``attnexport.model_interface``'s encoder convention)."""

    vocab_size: int | None
    max_model_len: int | None

    def encode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """``{input_ids [T] i64, positions [T] i64, cu_seqlens [S + 1] i32, token_type_ids
        [T] i64}`` -> ``[T, hidden]`` hidden states."""
        ...


def pack(
    sequences: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]] | None = None
) -> dict[str, np.ndarray]:
    """The encoder inputs of ``sequences`` packed without padding."""
    lengths = [len(s) for s in sequences]
    cu_seqlens = np.zeros(len(sequences) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    ids = np.fromiter((t for s in sequences for t in s), dtype=np.int64, count=cu_seqlens[-1])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    if token_type_ids is None:
        types = np.zeros_like(ids)
    else:
        types = np.fromiter(
            (t for s in token_type_ids for t in s), dtype=np.int64, count=cu_seqlens[-1]
        )
    return dict(zip(ENCODER_INPUT_NAMES, (ids, positions, cu_seqlens, types), strict=True))


def pool(hidden: np.ndarray, cu_seqlens: np.ndarray, config: EmbeddingConfig) -> np.ndarray:
    """``[T, H]`` packed hidden states -> ``[S, H]`` float32, one vector per (non-empty)
    sequence: the mean of its rows or its first row, then L2-normalised if asked (dividing
    by ``max(norm, 1e-12)``, as ``torch.nn.functional.normalize``)."""
    hidden = np.asarray(hidden, dtype=np.float32)
    starts, lengths = cu_seqlens[:-1].astype(np.int64), np.diff(cu_seqlens).astype(np.int64)
    if config.pooling == "cls":
        pooled = hidden[starts]
    else:
        pooled = np.add.reduceat(hidden, starts, axis=0) / lengths[:, None].astype(np.float32)
    if config.normalize:
        norms = np.linalg.norm(pooled, axis=-1, keepdims=True)
        pooled = pooled / np.maximum(norms, 1e-12)
    return pooled.astype(np.float32, copy=False)


class EmbeddingEngine:
    """Embeds sequences with an encoder executor, packing them into batches of at most
    ``max_num_batched_tokens`` tokens (a longer sequence runs alone).

    Args:
        executor: an :class:`OrtEncoderExecutor` or ``TorchEncoderExecutor``.
        config: pooling and normalisation (see :meth:`EmbeddingConfig.from_manifest`).
        max_num_batched_tokens: the token budget of one forward.
        directory: the export directory whose tokenizer :meth:`embed_texts` loads (once, on
            first use) when it is given none.
    """

    def __init__(
        self,
        executor: EncoderExecutor,
        config: EmbeddingConfig | None = None,
        max_num_batched_tokens: int = 8192,
        directory: str | os.PathLike | None = None,
    ) -> None:
        if max_num_batched_tokens < 1:
            raise UserError(
                f"max_num_batched_tokens: expected a positive int, got {max_num_batched_tokens}"
            )
        self.executor = executor
        self.config = config or EmbeddingConfig()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.directory = None if directory is None else Path(directory)
        self._tokenizer = None

    @classmethod
    def from_path(
        cls,
        path: str | os.PathLike,
        *,
        executor: str = "auto",
        num_threads: int | None = None,
        max_num_batched_tokens: int = 8192,
        trust_pickle: bool = False,
    ) -> EmbeddingEngine:
        """The engine of an encoder export directory (or its ``.onnx`` / ``.pt2``), pooling
        as its manifest says; ``executor``: ``auto``, ``ort`` or ``torch``."""
        from attnexport.artifact import artifact_dir, read_manifest, resolve_artifact

        manifest = read_manifest(Path(path))
        if manifest is not None and manifest.get("kind") != "encoder":
            raise UserError(
                f"artifact: {path} holds a {manifest.get('kind')} model "
                f"({manifest.get('architecture')}); embeddings come from encoder models (bert)"
            )
        kind, file = resolve_artifact(path, executor)
        limits = {
            "vocab_size": (manifest or {}).get("vocab_size"),
            "max_model_len": (manifest or {}).get("max_model_len"),
        }
        if kind == "ort":
            runner = OrtEncoderExecutor(file, num_threads=num_threads, **limits)
        else:
            from attnexport.runtime.executors.torch_encoder_executor import TorchEncoderExecutor

            runner = TorchEncoderExecutor(file, trust_pickle=trust_pickle, **limits)
        config = EmbeddingConfig.from_manifest(manifest)
        return cls(runner, config, max_num_batched_tokens, artifact_dir(Path(path)))

    def check(
        self, sequences: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]] | None
    ) -> None:
        """Raises EmbeddingInputError naming the first sequence the model cannot embed."""
        if isinstance(sequences, (str, bytes)) or not len(sequences):
            raise EmbeddingInputError("sequences: expected a non-empty list of token-id lists")
        vocab, limit = self.executor.vocab_size, self.executor.max_model_len
        for i, seq in enumerate(sequences):
            if not len(seq):
                raise EmbeddingInputError(f"sequences[{i}]: empty (nothing to embed)")
            if limit is not None and len(seq) > limit:
                raise EmbeddingInputError(
                    f"sequences[{i}]: {len(seq)} tokens, longer than the model's {limit} positions"
                )
            bad = [t for t in seq if not isinstance(t, (int, np.integer)) or t < 0]
            bad += [
                t
                for t in seq
                if vocab is not None and isinstance(t, (int, np.integer)) and t >= vocab
            ]
            if bad:
                raise EmbeddingInputError(
                    f"sequences[{i}]: token id {bad[0]!r} is not in [0, {vocab or 'vocab'})"
                )
        if token_type_ids is None:
            return
        if len(token_type_ids) != len(sequences) or any(
            len(t) != len(s) for t, s in zip(token_type_ids, sequences, strict=True)
        ):
            raise EmbeddingInputError(
                "token_type_ids: expected one list per sequence, of the same lengths"
            )

    def embed(
        self,
        sequences: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]] | None = None,
    ) -> np.ndarray:
        """``[len(sequences), hidden]`` float32: one vector per token-id sequence (special
        tokens included as given; ``token_type_ids``: segment ids, default zeros)."""
        self.check(sequences, token_type_ids)
        out: list[np.ndarray] = []
        start = 0
        while start < len(sequences):
            end, tokens = start, 0
            while end < len(sequences) and (
                end == start or tokens + len(sequences[end]) <= self.max_num_batched_tokens
            ):
                tokens += len(sequences[end])
                end += 1
            types = None if token_type_ids is None else token_type_ids[start:end]
            inputs = pack(sequences[start:end], types)
            hidden = self.executor.encode(inputs)
            out.append(pool(hidden, inputs["cu_seqlens"], self.config))
            start = end
        return np.concatenate(out)

    def tokenize(self, texts: Sequence[str], tokenizer) -> tuple[list[list[int]], list[list[int]]]:
        """Token ids and segment ids of ``texts`` as sentence-transformers makes them: special
        tokens added, truncated to ``max_seq_length`` (else the model's limit)."""
        if isinstance(texts, str) or not len(texts):
            raise EmbeddingInputError("texts: expected a non-empty list of strings")
        limit = self.config.max_seq_length or self.executor.max_model_len
        ids, types = [], []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise EmbeddingInputError(
                    f"texts[{i}]: expected a string, got {type(text).__name__}"
                )
            encoded = tokenizer.hf(
                text,
                add_special_tokens=True,
                truncation=limit is not None,
                max_length=limit,
                return_token_type_ids=True,
            )
            ids.append(list(encoded["input_ids"]))
            types.append(list(encoded.get("token_type_ids") or [0] * len(encoded["input_ids"])))
        return ids, types

    def embed_texts(self, texts: Sequence[str], tokenizer=None) -> np.ndarray:
        """``[len(texts), hidden]`` float32 sentence embeddings; ``tokenizer``: a
        :class:`~attnexport.runtime.text.Tokenizer` (default: the export directory's)."""
        if tokenizer is None:
            from attnexport.runtime.text import Tokenizer, TokenizerError

            if self.directory is None:
                raise TokenizerError("tokenizer: this engine has no export directory; pass one")
            if self._tokenizer is None:
                self._tokenizer = Tokenizer.from_directory(self.directory)
            tokenizer = self._tokenizer
        ids, types = self.tokenize(texts, tokenizer)
        return self.embed(ids, types)


class OrtEncoderExecutor:
    """An attnexport encoder ONNX file in onnxruntime (CPU), NumPy in and out.

    Args:
        model: path of the ``.onnx`` file.
        num_threads: intra-op threads (default:
            :func:`~attnexport.runtime.executors.ort_executor.default_num_threads`).
        vocab_size, max_model_len: the model's limits (from the manifest), checked before a
            run when given.
    """

    name = "onnxruntime"

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        num_threads: int | None = None,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        import onnxruntime as ort

        from attnexport.runtime.executors.ort_executor import default_session_options

        path = Path(model)
        if not path.is_file():
            raise UserError(f"model: no such .onnx file: {path}")
        options = default_session_options(num_threads)
        self.session = ort.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        names = [i.name for i in self.session.get_inputs()]
        missing = [n for n in ENCODER_INPUT_NAMES[:3] if n not in names]
        if missing:
            raise UserError(
                f"model: {path} is not an encoder in the attnexport convention; inputs "
                f"{missing} are missing (it takes {names})"
            )
        self.input_names = names
        self.path, self.vocab_size, self.max_model_len = path, vocab_size, max_model_len

    def encode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        feeds = {name: inputs[name] for name in self.input_names}
        return self.session.run(None, feeds)[0]
