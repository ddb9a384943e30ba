"""attnexport-domain nodes written into a finished ONNX model (the weight rewrites of
:mod:`attnexport.lowering.quantize`, after the lowering): the domain's opset import and each op's
function body, the standard ops stock onnxruntime runs where no native kernel claims the node."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir
from onnx import helper

from attnexport.model_contract import DOMAIN, DOMAIN_VERSION

EXTERNAL_DATA_BYTES = 64 * 2**20
"""Weights past this many bytes go to ``model.onnx.data``, written one tensor at a time: a
single file is serialized whole in memory first (a second and third copy of the weights beside
the model's; protobuf's 2 GiB limit besides). The lowering's rule, and the rewrites'."""


def add_function_body(
    model: onnx.ModelProto, op_type: str, body: Callable[[int], onnx.FunctionProto]
) -> None:
    """Declares the attnexport domain in ``model`` and adds ``body(opset)``, the function of
    ``op_type`` in the model's standard opset (18 when it imports none), unless it has one."""
    opsets = {o.domain: o.version for o in model.opset_import}
    if DOMAIN not in opsets:
        model.opset_import.append(helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if not any(f.domain == DOMAIN and f.name == op_type for f in model.functions):
        model.functions.append(body(opsets.get("", 18)))


def add_used_function_bodies(
    model: ir.Model, bodies: dict[str, Callable[[int], onnx.FunctionProto]]
) -> None:
    """:func:`add_function_body` for an ``onnx_ir`` model (the lowering's rewrites): for each op
    type of ``bodies`` that a main-graph node of the attnexport domain uses, its body in the
    model's standard opset, and the domain's opset import."""
    used = {node.op_type for node in model.graph if node.domain == DOMAIN}
    for op_type, body in bodies.items():
        if op_type in used:
            model.opset_imports[DOMAIN] = DOMAIN_VERSION
            function = ir.serde.deserialize_function(body(model.opset_imports[""]))
            model.functions[function.identifier()] = function


def save_rewritten(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Saves ``model`` (its weights' data loaded) over the ONNX file at ``path``: the weights in
    ``<path>.data`` when they are over 64 MiB (the lowering's rule), the old data file replaced;
    then onnx's full check of the file."""
    path = Path(path)
    external = sum(len(i.raw_data) for i in model.graph.initializer) > EXTERNAL_DATA_BYTES
    data = path.with_name(f"{path.name}.data")
    if data.exists():
        data.unlink()
    onnx.save(model, str(path), save_as_external_data=external, location=data.name)
    onnx.checker.check_model(str(path), full_check=True)
