"""One attnexport node as an ONNX model for the native kernels alone: no function body, so
the node runs only where the kernel library is registered. The kernel tests and
``benchmarks/ort_paged_attention_bandwidth.py`` build their graphs here, independently of the
lowering (whose single-node harness, :mod:`attnexport.lowering.single_node`, attaches the
standard-op bodies and derives the attributes from the op registry)."""

from __future__ import annotations

from collections.abc import Mapping

import onnx
import torch

from attnexport.model_contract import DOMAIN, DOMAIN_VERSION, GraphContract

_ONNX_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int8: onnx.TensorProto.INT8,
    torch.int32: onnx.TensorProto.INT32,
    torch.int64: onnx.TensorProto.INT64,
}


def _value(name: str, tensor: torch.Tensor) -> onnx.ValueInfoProto:
    dims = [f"{name}_{i}" for i in range(tensor.dim())]
    return onnx.helper.make_tensor_value_info(name, _ONNX_TYPES[tensor.dtype], dims)


def node_model(
    op_type: str,
    inputs: Mapping[str, torch.Tensor | None],
    outputs: Mapping[str, torch.Tensor],
    opset: int = 18,
    **attributes,
) -> onnx.ModelProto:
    """A model of one ``attnexport`` node ``op_type`` whose graph inputs and outputs are the
    node's, in order.

    Args:
        inputs: ``{name: tensor}`` in the node's input order; the tensor gives the graph input's
            dtype and rank (dims are symbolic). ``None`` leaves that optional input out (the
            empty name ``""``, the ONNX convention).
        outputs: ``{name: tensor}`` likewise; an output ``X_out`` is recorded in the graph
            contract as the in-place update of input ``X`` (what
            :class:`~attnexport.lowering.ort_session.PagedOrtSession` binds to ``X``'s buffer).
        attributes: the node's attributes (ints, floats).
    """
    graph_inputs = [_value(n, t) for n, t in inputs.items() if t is not None]
    node = onnx.helper.make_node(
        op_type,
        [n if t is not None else "" for n, t in inputs.items()],
        list(outputs),
        domain=DOMAIN,
        **attributes,
    )
    graph = onnx.helper.make_graph(
        [node], op_type, graph_inputs, [_value(n, t) for n, t in outputs.items()]
    )
    model = onnx.helper.make_model(
        graph,
        opset_imports=[
            onnx.helper.make_opsetid("", opset),
            onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION),
        ],
        ir_version=10,
    )
    written = {n.removesuffix("_out"): n for n in outputs if n.endswith("_out")}
    onnx.helper.set_model_props(model, GraphContract(DOMAIN, tuple(written), written).to_props())
    return model
