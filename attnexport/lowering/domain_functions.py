"""attnexport-domain nodes written into a finished ONNX model (the weight rewrites of
:mod:`attnexport.lowering.quantize`, after the lowering): the domain's opset import and each op's
function body, the standard ops stock onnxruntime runs where no native kernel claims the node."""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import helper

from attnexport.model_contract import DOMAIN, DOMAIN_VERSION


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
