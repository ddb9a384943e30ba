"""Which model file a path means, and which executor runs it; no torch."""

from __future__ import annotations

import os
from pathlib import Path

from attnexport.artifact.errors import ArtifactError
from attnexport.artifact.files import (
    EXECUTOR_FORMAT,
    EXECUTORS,
    MANIFEST,
    MODEL_FILES,
    ONNX_FILE,
    PT2_FILE,
    artifact_dir,
)
from attnexport.artifact.manifest import check_model_file, is_export_manifest, read_manifest
from attnexport.errors import UserError


def resolve_artifact(path: str | os.PathLike, executor: str = "auto") -> tuple[str, Path]:
    """(executor kind ``ort`` or ``torch``, verified model file) for ``path`` and the executor
    asked for.

    With a manifest, only the files it lists are candidates, and the chosen one is checked
    against its recorded size and SHA-256 (:func:`check_model_file`). ``auto`` takes onnxruntime
    for an ``.onnx`` file or a directory with ``model.onnx``, torch for a ``.pt2`` file or a
    directory with only ``model.pt2``.

    Raises:
        ArtifactError: the path does not exist, holds no usable model file, not the one
            ``executor`` needs, or a file the manifest does not list or whose digest differs.
    """
    if executor not in EXECUTORS:
        raise UserError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"artifact: {path} does not exist")
    manifest = read_manifest(path, plain_ok=True)
    if not is_export_manifest(manifest):
        manifest = None  # no list of model files: take the files present
    directory = artifact_dir(path)
    if path.is_dir():
        if manifest is not None:
            present = [k for k, f in EXECUTOR_FORMAT.items() if f in manifest["files"]]
        else:
            present = [k for k, f in EXECUTOR_FORMAT.items() if (path / MODEL_FILES[f]).is_file()]
        if not present:
            raise ArtifactError(
                f"artifact: {path} holds neither {ONNX_FILE} nor {PT2_FILE}; "
                "export a model there first (attnexport export MODEL --out DIR)"
            )
        kind = present[0] if executor == "auto" else executor
        if kind not in present:
            wanted = MODEL_FILES[EXECUTOR_FORMAT[kind]]
            raise ArtifactError(
                f"artifact: {path} has no {wanted} for --executor {kind}; "
                f"re-export with --format {EXECUTOR_FORMAT[kind]} or both"
            )
    else:
        kind = {".onnx": "ort", ".pt2": "torch"}.get(path.suffix)
        if kind is None:
            raise ArtifactError(
                f"artifact: expected a .onnx or .pt2 file or an export directory: {path}"
            )
        if executor not in ("auto", kind):
            raise ArtifactError(
                f"artifact: {path.name} runs on the {kind} executor, not {executor}"
            )
        if manifest is not None and path.name not in manifest["files"].values():
            raise ArtifactError(
                f"artifact: {path} is not a model file {directory / MANIFEST} lists "
                f"({sorted(manifest['files'].values())}); only listed files are loaded"
            )
    if manifest is None:
        return kind, path if path.is_file() else path / MODEL_FILES[EXECUTOR_FORMAT[kind]]
    return kind, check_model_file(manifest, directory, EXECUTOR_FORMAT[kind])
