"""Building an engine from what ``attnexport export`` writes: an export directory (``model.onnx``
and/or ``model.pt2``, optional ``manifest.json``), or one ``.onnx`` / ``.pt2`` file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from attnexport.custom_ops.dispatch import AUTO
from attnexport.runtime.config import CacheConfig, EncoderDecoderConfig, SchedulerConfig
from attnexport.runtime.engine import Engine
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.text import Tokenizer

EXECUTORS = ("auto", "ort", "torch")
ONNX_FILE, PT2_FILE, MANIFEST_FILE = "model.onnx", "model.pt2", "manifest.json"


def _manifest(path: Path) -> dict:
    """The manifest of an export directory or of the directory holding a model file ({} when
    there is none)."""
    manifest = (path if path.is_dir() else path.parent) / MANIFEST_FILE
    return json.loads(manifest.read_text()) if manifest.is_file() else {}


def encoder_decoder_config(path: str | os.PathLike) -> EncoderDecoderConfig | None:
    """The decoder start token an export manifest records (its ``generation`` defaults, from
    the checkpoint); None when it records none."""
    generation = _manifest(Path(path)).get("generation") or {}
    start = generation.get("decoder_start_token_id")
    return None if start is None else EncoderDecoderConfig(start)


def _manifest_max_len(directory: Path) -> int | None:
    """``max_model_len`` from a manifest: its own key, else the model config's
    ``max_position_embeddings``."""
    manifest = _manifest(directory)
    for value in (
        manifest.get("max_model_len"),
        (manifest.get("config") or {}).get("max_position_embeddings"),
    ):
        if isinstance(value, int):
            return value
    return None


def resolve_artifact(path: str | os.PathLike, executor: str = "auto") -> tuple[str, Path]:
    """(executor kind ``ort`` or ``torch``, model file) for ``path`` and the executor asked for.

    ``auto`` takes onnxruntime for an ``.onnx`` file or a directory holding ``model.onnx``,
    torch for a ``.pt2`` file or a directory holding only ``model.pt2``.

    Raises:
        ValueError: the path does not exist, holds no model file, or not the one ``executor``
            needs.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    path = Path(path)
    if not path.exists():
        raise ValueError(f"artifact: {path} does not exist")
    if path.is_dir():
        candidates = {"ort": path / ONNX_FILE, "torch": path / PT2_FILE}
        present = [kind for kind, file in candidates.items() if file.is_file()]
        if not present:
            raise ValueError(
                f"artifact: {path} holds neither {ONNX_FILE} nor {PT2_FILE}; "
                "export a model there first (attnexport export MODEL --out DIR)"
            )
        kind = present[0] if executor == AUTO else executor
        if kind not in present:
            wanted = candidates[kind].name
            raise ValueError(
                f"artifact: {path} has no {wanted} for --executor {kind}; "
                f"re-export with --format {'onnx' if kind == 'ort' else 'pt2'} or both"
            )
        return kind, candidates[kind]
    suffix_kind = {".onnx": "ort", ".pt2": "torch"}.get(path.suffix)
    if suffix_kind is None:
        raise ValueError(f"artifact: expected a .onnx or .pt2 file or an export directory: {path}")
    if executor not in (AUTO, suffix_kind):
        raise ValueError(
            f"artifact: {path.name} runs on the {suffix_kind} executor, not {executor}"
        )
    return suffix_kind, path


def load_executor(
    path: str | os.PathLike,
    *,
    executor: str = AUTO,
    backend: str = AUTO,
    device: str = "cpu",
    num_threads: int | None = None,
    max_model_len: int | None = None,
) -> Executor:
    """The executor for an export directory or a model file (see :func:`resolve_artifact`).

    Args:
        backend: attention backend of the torch executor (``auto``, ``sdpa``, ``ipex``, ...).
        device: ``cpu`` or ``cuda``.
        num_threads: onnxruntime intra-op threads (default: torch's thread count).
        max_model_len: overrides the length limit found in the file or the manifest.
    """
    kind, file = resolve_artifact(path, executor)
    if max_model_len is None and Path(path).is_dir():
        max_model_len = _manifest_max_len(Path(path))
    if kind == "ort":
        from attnexport.runtime.executors.ort_executor import OrtExecutor

        if backend != AUTO:
            raise ValueError(
                f"backend: {backend!r} applies to the torch executor; onnxruntime runs the "
                "model's own function bodies (use --executor torch to pick a backend)"
            )
        return OrtExecutor(
            file, device=device, num_threads=num_threads, max_model_len=max_model_len
        )
    from attnexport.runtime.executors.torch_executor import TorchExecutor

    return TorchExecutor(file, backend=backend, device=device, max_model_len=max_model_len)


def engine_from_path(
    path: str | os.PathLike,
    *,
    cache_config: CacheConfig | None = None,
    scheduler_config: SchedulerConfig | None = None,
    encoder_decoder: EncoderDecoderConfig | None = None,
    tokenizer: Tokenizer | None = None,
    **executor_options,
) -> Engine:
    """An :class:`Engine` over :func:`load_executor` ``(path, **executor_options)``; an
    encoder-decoder takes ``encoder_decoder``, else :func:`encoder_decoder_config` of ``path``.
    ``tokenizer`` (e.g. ``Tokenizer.from_directory(path)``) makes the engine take text prompts
    and return text."""
    executor = load_executor(path, **executor_options)
    if encoder_decoder is None and executor.cache_spec.num_cross_layers:
        encoder_decoder = encoder_decoder_config(path)
    return Engine(executor, cache_config, scheduler_config, encoder_decoder, tokenizer)
