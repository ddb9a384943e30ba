"""Lowering: torch.export passes and ONNX translation of the attnexport ops.

* :func:`export_program` — ``torch.export`` of a model on the attnexport ops, checked.
* :func:`to_onnx` — an ONNX file with ``attnexport``-domain nodes carrying standard-op function
  bodies (or other targets, see :mod:`.targets`), caches exposed as ``<input>_out`` outputs,
  readable dimension names and the metadata of :mod:`.metadata`.
* :class:`PagedOrtSession` — runs such a file in onnxruntime with the caches updated in place.

``docs/lowering.md`` is the user guide. ``onnx``/``onnxscript``/``onnxruntime`` load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnexport.lowering.export import export_program

if TYPE_CHECKING:
    from attnexport.lowering.metadata import ModelMetadata, read_metadata
    from attnexport.lowering.onnx_export import to_onnx
    from attnexport.lowering.ort_session import PagedOrtSession
    from attnexport.lowering.targets import TARGETS

_LAZY = {
    "to_onnx": "attnexport.lowering.onnx_export",
    "ModelMetadata": "attnexport.lowering.metadata",
    "read_metadata": "attnexport.lowering.metadata",
    "PagedOrtSession": "attnexport.lowering.ort_session",
    "TARGETS": "attnexport.lowering.targets",
}

__all__ = [
    "TARGETS",
    "ModelMetadata",
    "PagedOrtSession",
    "export_program",
    "read_metadata",
    "to_onnx",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attnexport.lowering' has no attribute {name!r}")
