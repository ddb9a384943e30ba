"""Lowering: torch.export passes and ONNX translation of the attnexport ops.

* :func:`export_program` — ``torch.export`` of a model on the attnexport ops, checked.
* :func:`to_onnx` — an ONNX file with ``attnexport``-domain nodes carrying standard-op function
  bodies (or other targets, see :mod:`.targets`), caches exposed as ``<input>_out`` outputs,
  readable dimension names and the graph contract of :mod:`.model_contract` (its
  ``metadata_props``: which inputs are caches, their geometry, the target).
* :func:`quantize_weights` — int4/int8 weight-only quantization of such a file (MatMulNBits,
  onnxruntime's quantizer; :mod:`.quantize`).
* :class:`PagedOrtSession` — runs such a file in onnxruntime with the caches updated in place.

``docs/lowering.md`` is the user guide. ``onnx``/``onnxscript``/``onnxruntime`` load lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnexport.lowering.export import export_program

if TYPE_CHECKING:
    from attnexport.lowering.model_contract import GraphContract, read_contract
    from attnexport.lowering.onnx_export import to_onnx
    from attnexport.lowering.ort_session import PagedOrtSession
    from attnexport.lowering.quantize import (
        ACTIVATIONS,
        ALGORITHMS,
        DECODE_ACTIVATIONS,
        LM_HEAD_FORMATS,
        PREFILL_ACTIVATIONS,
        WEIGHT_FORMATS,
        ZERO_POINT_OFFSETS,
        QuantizationError,
        WeightQuantization,
        quantize_weights,
    )
    from attnexport.lowering.targets import TARGETS

_LAZY = {
    "to_onnx": "attnexport.lowering.onnx_export",
    "GraphContract": "attnexport.lowering.model_contract",
    "read_contract": "attnexport.lowering.model_contract",
    "PagedOrtSession": "attnexport.lowering.ort_session",
    "TARGETS": "attnexport.lowering.targets",
    "WEIGHT_FORMATS": "attnexport.lowering.quantize",
    "ACTIVATIONS": "attnexport.lowering.quantize",
    "ALGORITHMS": "attnexport.lowering.quantize",
    "DECODE_ACTIVATIONS": "attnexport.lowering.quantize",
    "LM_HEAD_FORMATS": "attnexport.lowering.quantize",
    "PREFILL_ACTIVATIONS": "attnexport.lowering.quantize",
    "ZERO_POINT_OFFSETS": "attnexport.lowering.quantize",
    "QuantizationError": "attnexport.lowering.quantize",
    "WeightQuantization": "attnexport.lowering.quantize",
    "quantize_weights": "attnexport.lowering.quantize",
}

__all__ = [
    "ACTIVATIONS",
    "ALGORITHMS",
    "DECODE_ACTIVATIONS",
    "LM_HEAD_FORMATS",
    "PREFILL_ACTIVATIONS",
    "TARGETS",
    "WEIGHT_FORMATS",
    "ZERO_POINT_OFFSETS",
    "GraphContract",
    "PagedOrtSession",
    "QuantizationError",
    "WeightQuantization",
    "export_program",
    "quantize_weights",
    "read_contract",
    "to_onnx",
]

# The names before the graph contract was named for what it is ("metadata" is the per-step
# attention metadata); kept for the users of the earlier public API.
_RENAMED = {"ModelMetadata": "GraphContract", "read_metadata": "read_contract"}


def __getattr__(name: str):
    name = _RENAMED.get(name, name)
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attnexport.lowering' has no attribute {name!r}")
