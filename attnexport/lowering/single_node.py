"""One attnexport node in onnxruntime (its body, or the native kernels): the harness the
kernel tests, the fuzz suite and ``benchmarks/ort_paged_attention.py`` run single ops through."""

from __future__ import annotations

import torch

from attnexport.lowering.ort_session import PagedOrtSession


def single_node_session(
    op_type: str,
    inputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    kernels: str = "bodies",
    num_threads: int = 2,
    opset: int = 18,
    **attributes,
) -> PagedOrtSession:
    """A :class:`~attnexport.lowering.ort_session.PagedOrtSession` of one attnexport node
    (``op_type``) with its body and, for ``kernels="native"``, the native kernels registered.
    ``inputs``/``outputs`` name the node's tensors (their dtypes and ranks make the graph's
    types; dims are symbolic); a cache output ``X_out`` is written in place into input ``X``.
    The geometry attributes come from the inputs' shapes, as in an export."""
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort

    from attnexport import ort_kernels
    from attnexport.lowering.model_contract import GraphContract
    from attnexport.lowering.registry import DOMAIN, all_bodies, onnx_ops, register_schemas

    types = {
        torch.float32: ir.DataType.FLOAT,
        torch.float16: ir.DataType.FLOAT16,
        torch.bfloat16: ir.DataType.BFLOAT16,
        torch.int32: ir.DataType.INT32,
        torch.int64: ir.DataType.INT64,
        torch.int8: ir.DataType.INT8,
    }
    register_schemas()
    geometry = onnx_ops()[op_type].geometry(lambda name, axis: inputs[name].shape[axis])

    def values(tensors: dict[str, torch.Tensor]) -> list[ir.Value]:
        return [
            ir.Value(
                name=name,
                type=ir.TensorType(types[t.dtype]),
                shape=ir.Shape([f"{name}_{i}" for i in range(t.dim())]),
            )
            for name, t in tensors.items()
        ]

    graph_inputs, graph_outputs = values(inputs), values(outputs)
    # The node's inputs in its ports' order, an omitted optional one left empty (a float-cache
    # node with attention sinks has no scale caches before its sinks).
    ports = onnx_ops()[op_type].inputs
    given = {value.name: value for value in graph_inputs}
    unknown = set(given) - {port.name for port in ports}
    if unknown:
        raise ValueError(f"inputs: {sorted(unknown)} are not inputs of {op_type}")
    last = max(i for i, port in enumerate(ports) if port.name in given)
    node = ir.Node(
        DOMAIN,
        op_type,
        [given.get(port.name) for port in ports[: last + 1]],
        attributes=ir.convenience.convert_attributes(geometry | attributes),
        outputs=graph_outputs,
    )
    graph = ir.Graph(
        graph_inputs,
        graph_outputs,
        nodes=[node],
        opset_imports={"": opset, DOMAIN: 1},
        name=op_type,
    )
    scaled = any(port.scale and port.name in given for port in ports)
    sinks = any(port.sinks and port.name in given for port in ports)
    model = ir.Model(graph, ir_version=10, functions=all_bodies(opset, scaled, sinks))
    written = {n.removesuffix("_out"): n for n in outputs if n.endswith("_out")}
    model.metadata_props.update(GraphContract("attnexport", tuple(written), written).to_props())
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    if kernels == "native":
        ort_kernels.register(options)
    return PagedOrtSession(proto, session_options=options)
