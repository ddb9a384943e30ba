"""Every registry of the ONNX lowering, built from the op slices' ONNX faces.

Iterates :data:`~attnexport.custom_ops.slices.OP_SLICES` and imports each
``attnexport.custom_ops.<slice>.onnx`` (its ``ONNX_OPS``, see
:class:`~attnexport.custom_ops.onnx_spec.OnnxOp`): the ``onnx.defs`` schemas, the function bodies,
the torch.onnx translation table, the KV-cache arguments of the torch ops and the dimension
names their inputs give. Adding an op is adding a slice; nothing here changes.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping

import onnx
import onnx_ir as ir

from attnexport.custom_ops.onnx_spec import OnnxOp
from attnexport.custom_ops.slices import OP_SLICES
from attnexport.model_contract import DOMAIN, DOMAIN_VERSION

__all__ = ["DOMAIN", "DOMAIN_VERSION", "all_bodies", "onnx_ops", "register_schemas"]


@functools.cache
def onnx_ops() -> Mapping[str, OnnxOp]:
    """``{node op_type: its OnnxOp}`` of every slice, in :data:`OP_SLICES` order."""
    ops: dict[str, OnnxOp] = {}
    for name in OP_SLICES:
        for spec in importlib.import_module(f"attnexport.custom_ops.{name}.onnx").ONNX_OPS:
            if spec.node in ops:
                raise ValueError(f"attnexport node {spec.node}: defined by two slices")
            ops[spec.node] = spec
    return ops


@functools.cache
def register_schemas() -> None:
    """Registers the attnexport schemas with ``onnx.defs`` once per process.

    A name must not be a standard op's (ONNX 23 has ``RotaryEmbedding``): ``onnx.reference``,
    which onnxscript imports, refuses two schemas of one name in different domains, so the
    import of onnxscript would fail in any process that registered first."""
    for spec in onnx_ops().values():
        schema = spec.schema()
        if onnx.defs.has(schema.name, ""):
            raise ValueError(f"attnexport node {schema.name}: a standard ONNX op has this name")
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


def all_bodies(opset: int, scaled: bool = False, sinks: bool = False) -> list[ir.Function]:
    """The bodies of every attnexport node, for a model of standard opset ``opset`` (>= 18);
    ``scaled``: the variants for int8 KV caches (nodes with scale-cache inputs); ``sinks``:
    for attention with sinks (nodes with the sink input)."""
    if opset < 18:
        raise ValueError(f"opset: expected a standard ONNX opset >= 18, got {opset}")
    return [spec.function(opset, scaled, sinks) for spec in onnx_ops().values()]


def torch_op_specs() -> dict[str, tuple[OnnxOp, bool]]:
    """``{torch op name: (its node's OnnxOp, whether it writes the caches in place)}``."""
    specs: dict[str, tuple[OnnxOp, bool]] = {}
    for spec in onnx_ops().values():
        specs[spec.torch_op] = (spec, False)
        if spec.in_place_op is not None:
            specs[spec.in_place_op] = (spec, True)
    return specs


def translation_table() -> dict[Callable, Callable]:
    """``{torch op overload: translation}`` for ``torch.onnx.export(custom_translation_table=)``.

    Only the functional ops are translated: an in-place op (``reshape_and_cache``) is rewritten
    to its functional twin first (:mod:`attnexport.lowering.passes`)."""
    import torch

    register_schemas()
    ops = torch.ops.attnexport
    return {getattr(ops, s.torch_op).default: s.translate for s in onnx_ops().values()}
