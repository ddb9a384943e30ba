"""The executor for what ``attnexport export`` writes: an export directory (``model.onnx``
and/or ``model.pt2``, optional ``manifest.json``), or one ``.onnx`` / ``.pt2`` file
(:func:`attnexport.runtime.engine.engine_from_path` builds an engine over it).

:mod:`attnexport.artifact` (paths, manifests, ``.pt2`` safety) is imported when a path is
loaded: it imports torch, which the serving core must not need to be imported."""

from __future__ import annotations

import os
from pathlib import Path

from attnexport.errors import UserError
from attnexport.runtime.config import EncoderDecoderConfig, checked_max_model_len
from attnexport.runtime.executors.base import Executor
from attnexport.runtime.text import Tokenizer

_MODEL_FILE_FAILURES = ("Load model from", "External data path")
"""How onnxruntime's errors about the file itself begin (a protobuf without a graph, an invalid
graph, external data outside the model's directory), as opposed to errors of the session."""
AUTO = "auto"
"""The default executor and backend choice (``attnexport.artifact.EXECUTORS``' and
``attnexport.custom_ops.dispatch.AUTO``' name)."""


def artifact_tokenizer(directory: str | os.PathLike, manifest: dict | None) -> Tokenizer | None:
    """The tokenizer an export directory holds (the files its manifest lists, or any tokenizer
    file when there is no manifest); None when it holds none. MissingDependencyError (a
    ModuleNotFoundError) when transformers is missing."""
    from attnexport.artifact import TOKENIZER_FILES

    directory = Path(directory)
    if manifest is not None:
        present = bool(manifest.get("tokenizer_files"))
    else:
        present = any((directory / name).is_file() for name in TOKENIZER_FILES)
    return Tokenizer.from_directory(directory) if present else None


def _manifest(path: Path) -> dict:
    """The manifest of an export directory or of the directory holding a model file (validated
    when ``attnexport export`` wrote it; {} when there is none)."""
    from attnexport.artifact import read_manifest

    return read_manifest(path, plain_ok=True) or {}


def encoder_decoder_config(path: str | os.PathLike) -> EncoderDecoderConfig | None:
    """The decoder start token an export manifest records (its ``generation`` defaults, from
    the checkpoint); None when it records none."""
    generation = _manifest(Path(path)).get("generation") or {}
    start = generation.get("decoder_start_token_id")
    return None if start is None else EncoderDecoderConfig(start)


def _manifest_max_len(path: Path) -> int | None:
    """The longest sequence the manifest of an export directory or of the directory holding a
    model file declares (:func:`attnexport.artifact.manifest.manifest_max_model_len`)."""
    from attnexport.artifact import MANIFEST, artifact_dir
    from attnexport.artifact.manifest import manifest_max_model_len

    return manifest_max_model_len(_manifest(path), artifact_dir(path) / MANIFEST)


def _manifest_rope_switch(path: Path) -> int | None:
    """``rope_switch_length`` from the manifest of an export directory or of the directory
    holding a model file (None: none recorded, e.g. an older export)."""
    value = _manifest(path).get("rope_switch_length")
    return value if isinstance(value, int) else None


def load_executor(
    path: str | os.PathLike,
    *,
    executor: str = AUTO,
    backend: str = AUTO,
    device: str = "cpu",
    num_threads: int | None = None,
    max_model_len: int | None = None,
    trust_pickle: bool = False,
) -> Executor:
    """The executor for an export directory or a model file (see
    :func:`attnexport.artifact.resolve_artifact`).

    Args:
        backend: attention backend of the torch executor (``auto``, ``sdpa``, ``ipex``, ...).
        device: ``cpu`` or ``cuda``.
        num_threads: onnxruntime intra-op threads (default: torch's thread count).
        max_model_len: a shorter length limit than the one found in the manifest or the file
            (a longer one is refused: UserError).
        trust_pickle: load a ``.pt2`` even when it holds pickled entries that can run code
            (see :func:`attnexport.artifact.load_pt2`); only for files you trust.

    Raises:
        ArtifactError: see :func:`attnexport.artifact.resolve_artifact`; a model file that
            onnxruntime or torch.export cannot parse.
        UnsafeArtifactError: a ``.pt2`` that would run code, without ``trust_pickle``.
    """
    from attnexport.artifact import ArtifactError, resolve_artifact

    kind, file = resolve_artifact(path, executor)
    max_model_len = checked_max_model_len(
        max_model_len, _manifest_max_len(Path(path)), "its export manifest's max_model_len"
    )
    rope_switch_length = _manifest_rope_switch(Path(path))
    if kind == "ort":
        from attnexport.runtime.executors.ort_executor import OrtExecutor

        if backend != AUTO:
            raise UserError(
                f"backend: {backend!r} applies to the torch executor; onnxruntime runs the "
                "model's own function bodies (use --executor torch to pick a backend)"
            )
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

        try:
            return OrtExecutor(
                file,
                device=device,
                num_threads=num_threads,
                max_model_len=max_model_len,
                rope_switch_length=rope_switch_length,
            )
        except (
            ort_errors.InvalidProtobuf,
            ort_errors.InvalidArgument,
            ort_errors.InvalidGraph,
            ort_errors.Fail,
        ) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            if not isinstance(error, ort_errors.InvalidProtobuf) and not any(
                cause in reason for cause in _MODEL_FILE_FAILURES
            ):
                raise
            raise ArtifactError(
                f"{file}: not a valid ONNX model ({reason}); re-export it"
            ) from None
    from attnexport.runtime.executors.torch_executor import TorchExecutor

    return TorchExecutor(
        file,
        backend=backend,
        device=device,
        max_model_len=max_model_len,
        rope_switch_length=rope_switch_length,
        trust_pickle=trust_pickle,
    )
