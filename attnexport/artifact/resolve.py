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
from attnexport.artifact.manifest import (
    check_model_file,
    is_export_manifest,
    read_manifest,
    require_model_bytes,
)
from attnexport.artifact.onnx_data import check_external_data, ort_checks_external_data
from attnexport.contained_files import UnsafePathError, contained_file
from attnexport.errors import UserError


def resolve_artifact(path: str | os.PathLike, executor: str = "auto") -> tuple[str, Path]:
    """(executor kind ``ort`` or ``torch``, verified model file) for ``path`` and the executor
    asked for.

    A directory is an export directory: only the files its manifest lists are candidates,
    and the chosen one is checked against its recorded size and SHA-256
    (:func:`check_model_file`); without a manifest it is refused, with a hand-written one (no
    ``format``) its model files are taken. A model file named directly is loaded as it is when
    no export manifest lies beside it. No file of a directory may be a link. ``auto`` takes
    onnxruntime for an ``.onnx`` file or a directory with ``model.onnx``, torch for a ``.pt2``
    file or a directory with only ``model.pt2``.

    Raises:
        ArtifactError: the path does not exist, holds no usable model file, not the one
            ``executor`` needs, an empty file, or a file the manifest does not list or whose
            digest differs.
        IncompleteArtifactError: a directory with a model file but no manifest.
        UnsafePathError: a file of the directory that is a link or not a regular file.
    """
    if executor not in EXECUTORS:
        raise UserError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"artifact: {path} does not exist")
    manifest = read_manifest(path, plain_ok=True)
    if not is_export_manifest(manifest):
        manifest = None  # none or a hand-written one: no list of model files
    directory = artifact_dir(path)
    if path.is_dir():
        if manifest is not None:
            present = [k for k, f in EXECUTOR_FORMAT.items() if f in manifest["files"]]
        else:  # a hand-written manifest (no list of model files): take the files present
            present = [
                k
                for k, f in EXECUTOR_FORMAT.items()
                if contained_file(path, MODEL_FILES[f]).is_file()
            ]
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
        if manifest is None:
            return _unlisted(contained_file(path, MODEL_FILES[EXECUTOR_FORMAT[kind]]), kind)
        return kind, check_model_file(manifest, directory, EXECUTOR_FORMAT[kind])
    kind = {".onnx": "ort", ".pt2": "torch"}.get(path.suffix)
    if kind is None:
        raise ArtifactError(
            f"artifact: expected a .onnx or .pt2 file or an export directory: {path}"
        )
    if executor not in ("auto", kind):
        raise ArtifactError(f"artifact: {path.name} runs on the {kind} executor, not {executor}")
    if manifest is None:
        if not path.is_file():
            raise UnsafePathError(f"{path}: not a regular file")
        return _unlisted(path, kind)
    if path.name not in manifest["files"].values():
        raise ArtifactError(
            f"artifact: {path} is not a model file {directory / MANIFEST} lists "
            f"({sorted(manifest['files'].values())}); only listed files are loaded"
        )
    return kind, check_model_file(manifest, directory, EXECUTOR_FORMAT[kind])


def _unlisted(file: Path, kind: str) -> tuple[str, Path]:
    """``(kind, file)`` for a model file no export manifest lists, checked as far as it can
    be without one: not empty, its ONNX external data in its directory."""
    require_model_bytes(file)
    if kind == "ort" and not ort_checks_external_data():
        check_external_data(file)
    return kind, file
