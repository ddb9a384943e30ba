"""Export directories, the one home of what ``attnexport export`` writes and every loader
reads; the CLI and ``attnexport.runtime.loading`` both use this package (it imports neither).

* :mod:`.files` — file names, which model file each executor reads (no torch).
* :mod:`.manifest` — ``manifest.json``: its keys, building, writing, reading, validation, and
  the sizes and SHA-256 digests of the model files (no torch).
* :mod:`.resolve` — which model file a path means (no torch).
* :mod:`.onnx_data` — an ``.onnx`` file's external data stays in its directory (no torch).
* :mod:`.staging` — an export is written into a staging directory and moved into place when
  complete; an earlier export in the target (no torch).
* :mod:`.pt2` — safe ``.pt2`` loading (the archive is inspected; nothing is unpickled).
* :mod:`.eager` — what a manifest rebuilds in torch: dtypes, cache geometry, the eager model.
* :mod:`.export` — writing an export directory (``attnexport export``).

``import attnexport.artifact`` loads no torch: the names of :mod:`.pt2`, :mod:`.eager` and
:mod:`.export` load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from attnexport.artifact.errors import ArtifactError, IncompleteArtifactError, UnsafeArtifactError
from attnexport.artifact.files import (
    EXECUTOR_FORMAT,
    EXECUTORS,
    EXPORT_FILES,
    FORMATS,
    MANIFEST,
    MODEL_FILES,
    ONNX_DATA_FILE,
    ONNX_FILE,
    PT2_FILE,
    TOKENIZER_FILES,
    artifact_dir,
)
from attnexport.artifact.manifest import (
    DTYPE_NAMES,
    FORMAT,
    FORMAT_VERSION,
    KINDS,
    check_model_file,
    file_digest,
    generation_defaults,
    is_export_manifest,
    model_file_digests,
    read_manifest,
    validate_manifest,
    write_manifest,
)
from attnexport.artifact.resolve import resolve_artifact
from attnexport.artifact.staging import earlier_export

if TYPE_CHECKING:
    from attnexport.artifact.eager import DTYPES, manifest_cache_spec, rebuild_eager_model
    from attnexport.artifact.export import (
        CPU_UNRUNNABLE,
        ExportOptions,
        check_finite_weights,
        export_artifact,
        quantize_export,
    )
    from attnexport.artifact.pt2 import inspect_pt2, load_pt2, save_pt2

_LAZY = {
    "DTYPES": "eager",
    "manifest_cache_spec": "eager",
    "rebuild_eager_model": "eager",
    "CPU_UNRUNNABLE": "export",
    "ExportOptions": "export",
    "check_finite_weights": "export",
    "export_artifact": "export",
    "quantize_export": "export",
    "inspect_pt2": "pt2",
    "load_pt2": "pt2",
    "save_pt2": "pt2",
}

__all__ = [
    "CPU_UNRUNNABLE",
    "DTYPES",
    "DTYPE_NAMES",
    "EXECUTORS",
    "EXECUTOR_FORMAT",
    "EXPORT_FILES",
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "KINDS",
    "MANIFEST",
    "MODEL_FILES",
    "ONNX_DATA_FILE",
    "ONNX_FILE",
    "PT2_FILE",
    "TOKENIZER_FILES",
    "ArtifactError",
    "ExportOptions",
    "IncompleteArtifactError",
    "UnsafeArtifactError",
    "artifact_dir",
    "check_finite_weights",
    "check_model_file",
    "earlier_export",
    "export_artifact",
    "file_digest",
    "generation_defaults",
    "inspect_pt2",
    "is_export_manifest",
    "load_pt2",
    "manifest_cache_spec",
    "model_file_digests",
    "quantize_export",
    "read_manifest",
    "rebuild_eager_model",
    "resolve_artifact",
    "save_pt2",
    "validate_manifest",
    "write_manifest",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"attnexport.artifact.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnexport.artifact' has no attribute {name!r}")
