"""One attnexport node in onnxruntime (its body, or the native kernels): the harness the
kernel tests, the fuzz suite and ``benchmarks/ort_paged_attention.py`` run single ops through."""

from __future__ import annotations

import torch

from attnexport.lowering.ort_session import PagedOrtSession


def _geometry(op_type: str, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The static-shape attributes the exporter sets on ``op_type`` for these inputs."""
    if op_type in ("NeoxRotaryEmbedding", "SiluAndMul", "FusedAddRMSNorm"):
        return {}
    if op_type == "NeoxQKVRotaryEmbedding":
        return {}  # the head counts are not in the shapes: the caller passes them
    if op_type == "ReshapeAndCache":
        return {"block_size": inputs["key_cache"].shape[1]}
    paged = op_type == "PagedAttention"
    keys = inputs["key_cache"] if paged else inputs["key"]
    heads = {
        "num_heads": inputs["query"].shape[1],
        "num_kv_heads": keys.shape[-2],
        "head_size": inputs["query"].shape[2],
    }
    return heads | ({"block_size": keys.shape[1]} if paged else {})


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
    import onnxruntime as ort
    from onnx import helper

    from attnexport.lowering import bodies
    from attnexport.lowering.metadata import ModelMetadata
    from attnexport.lowering.ort_session import PagedOrtSession
    from attnexport.lowering.schemas import DOMAIN, register_schemas
    from attnexport.runtime import ort_kernels

    types = {
        torch.float32: onnx.TensorProto.FLOAT,
        torch.float16: onnx.TensorProto.FLOAT16,
        torch.bfloat16: onnx.TensorProto.BFLOAT16,
        torch.int32: onnx.TensorProto.INT32,
        torch.int64: onnx.TensorProto.INT64,
    }
    register_schemas()
    attributes = _geometry(op_type, inputs) | attributes

    def info(name, tensor):
        dims = [f"{name}_{i}" for i in range(tensor.dim())]
        return helper.make_tensor_value_info(name, types[tensor.dtype], dims)

    node = helper.make_node(op_type, list(inputs), list(outputs), domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [node],
        op_type,
        [info(n, t) for n, t in inputs.items()],
        [info(n, t) for n, t in outputs.items()],
    )
    written = {n.removesuffix("_out"): n for n in outputs if n.endswith("_out")}
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
        functions=bodies.all_bodies(opset),
        ir_version=10,
    )
    props = ModelMetadata("attnexport", tuple(written), written).to_props()
    helper.set_model_props(model, props)
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = num_threads
    if kernels == "native":
        ort_kernels.register(options)
    return PagedOrtSession(model, session_options=options)
