"""The logits projection (``lm_head``) quantized on its own terms, and a tied embedding kept as
one table.

The projection becomes ``com.microsoft.MatMulNBits`` on symmetric int8 or int4 blocks along the
input dimension (onnxruntime's C++ block quantizer, round to nearest). MatMulNBits stores its
weight as ``[N, blocks, block bytes]``: row ``n`` of the ``[N, K]`` weight, block by block, which
is also the embedding table's row ``n`` when the embedding is tied. So a ``Gather`` of the tied
table becomes ``com.microsoft.GatherBlockQuantized`` on the *same* initializer (uint8 data and
MatMulNBits' conventions: zero point 8 for int4, 128 for int8), its scales a ``[N, blocks, 1]``
view of the projection's, its ``[tokens, blocks, block]`` rows reshaped to ``[tokens, K]``:
the table is stored once, quantized, and both read it.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport.lowering.quantization_error import QuantizationError
from attnexport.matmul_nbits import matmulnbits_node


class LmHeadError(QuantizationError):
    """The logits projection's weight is read by a node this module cannot rewrite."""


def block_quantize(weight_nk: np.ndarray, bits: int, block_size: int):
    """``(packed [N, blocks, block bytes] uint8, scales [N, blocks] float32)``: symmetric round
    to nearest per block along K (onnxruntime's quantizer)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=bits)
    packed, scales, _ = DefaultWeightOnlyQuantizer(config).qbits_block_quant(
        np.ascontiguousarray(weight_nk.T, dtype=np.float32)
    )
    return packed, scales.reshape(weight_nk.shape[0], -1)


def _initializer(graph: onnx.GraphProto, name: str) -> onnx.TensorProto:
    return next(i for i in graph.initializer if i.name == name)


def quantize_lm_head(
    model: onnx.ModelProto,
    node_name: str,
    *,
    bits: int,
    block_size: int,
    accuracy_level: int,
    base_dir: str = "",
) -> None:
    """Rewrites, in place, the logits projection ``node_name`` (``MatMul(x, W[K, N])`` or the
    tied ``Gemm(x, E[N, K], transB=1)``) into MatMulNBits, and every ``Gather`` of a tied ``E``
    into GatherBlockQuantized on the same quantized table (module doc). A weight in an external
    data file is read from ``base_dir``.

    Raises:
        LmHeadError: another kind of node reads the weight.
    """
    graph = model.graph
    position, node = next((i, n) for i, n in enumerate(graph.node) if n.name == node_name)
    weight_name = node.input[1]
    weight = numpy_helper.to_array(_initializer(graph, weight_name), base_dir)
    weight_nk = weight if node.op_type == "Gemm" else weight.T
    n, k = weight_nk.shape
    packed, scales = block_quantize(weight_nk, bits, block_size)
    blocks = packed.shape[1]
    data_name, scales_name = f"{weight_name}_Q{bits}", f"{weight_name}_scales"
    graph.initializer.extend(
        [numpy_helper.from_array(packed, data_name), numpy_helper.from_array(scales, scales_name)]
    )
    matmul = matmulnbits_node(
        [node.input[0], data_name, scales_name],
        node.output[0],
        name=f"{node.name}_Q{bits}",
        k=k,
        n=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
    graph.node.remove(node)
    graph.node.insert(position, matmul)

    readers = [r for r in graph.node if weight_name in r.input]
    gathers = [r for r in readers if r.op_type == "Gather" and r.input[0] == weight_name]
    if len(gathers) != len(readers) or (gathers and node.op_type != "Gemm"):
        names = ", ".join(f"{r.op_type} {r.name}" for r in readers)
        raise LmHeadError(f"lm_head: its weight {weight_name!r} is also read by {names}")
    for gather in gathers:
        _gather_quantized(graph, gather, data_name, scales_name, bits, block_size, blocks, k)
    graph.initializer.remove(_initializer(graph, weight_name))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def _gather_quantized(
    graph: onnx.GraphProto,
    gather: onnx.NodeProto,
    data_name: str,
    scales_name: str,
    bits: int,
    block_size: int,
    blocks: int,
    k: int,
) -> None:
    """``Gather(E, ids)`` -> ``GatherBlockQuantized(E_q, ids, scales[N, blocks, 1])`` reshaped
    to ``ids.shape + [K]`` (the padding of a last partial block sliced off)."""
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    if axis != 0:
        raise LmHeadError(f"lm_head: the embedding Gather {gather.name} has axis {axis}")
    prefix = gather.name or data_name
    ids, (out,) = gather.input[1], gather.output
    padded = blocks * block_size != k
    constants = {
        f"{prefix}_scales_shape": np.array([-1, blocks, 1], np.int64),
        f"{prefix}_row": np.array([blocks * block_size], np.int64),
    }
    if padded:
        constants |= {
            f"{prefix}_start": np.array([0], np.int64),
            f"{prefix}_end": np.array([k], np.int64),
            f"{prefix}_last": np.array([-1], np.int64),
        }
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in constants.items())
    nodes = [
        helper.make_node("Reshape", [scales_name, f"{prefix}_scales_shape"], [f"{prefix}_scales3"]),
        helper.make_node(
            "GatherBlockQuantized",
            [data_name, ids, f"{prefix}_scales3"],
            [f"{prefix}_blocks"],
            name=f"{prefix}_Q{bits}",
            domain="com.microsoft",
            gather_axis=0,
            quantize_axis=2,
            block_size=block_size,
            bits=bits,
        ),
        helper.make_node("Shape", [ids], [f"{prefix}_ids_shape"]),
        helper.make_node(
            "Concat", [f"{prefix}_ids_shape", f"{prefix}_row"], [f"{prefix}_shape"], axis=0
        ),
        helper.make_node(
            "Reshape",
            [f"{prefix}_blocks", f"{prefix}_shape"],
            [f"{prefix}_padded" if padded else out],
        ),
    ]
    if padded:
        nodes.append(
            helper.make_node(
                "Slice",
                [f"{prefix}_padded", f"{prefix}_start", f"{prefix}_end", f"{prefix}_last"],
                [out],
            )
        )
    position = list(graph.node).index(gather)
    graph.node.remove(gather)
    for offset, new in enumerate(nodes):
        graph.node.insert(position + offset, new)
