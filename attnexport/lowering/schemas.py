"""The ``attnexport`` ONNX domain: its name, version and the schemas of its nodes.

The schemas are defined by the op slices (``attnexport/custom_ops/<slice>/onnx.py``);
:func:`register_schemas` adds them to ``onnx.defs`` (idempotent), which the ONNX translation
and ``onnx.checker`` need. The nodes implement docs/ops.md.
"""

from __future__ import annotations

from attnexport.lowering.registry import DOMAIN, DOMAIN_VERSION, register_schemas

__all__ = ["DOMAIN", "DOMAIN_VERSION", "register_schemas"]
