"""MatMulNBits with float zero points (HQQ), rewritten onto the packed kernels.

HQQ fits a float zero point per block: ``W[k, n] = (q[k, n] - z[b, n]) * s[b, n]`` for ``k`` in
block ``b``. onnxruntime's CPU MatMulNBits takes such zero points but has no packed kernel for
them: it dequantizes the whole weight to float32 on every call (several times slower than the
packed kernels at decode). Without zero points the kernel subtracts its default ``m`` (8 for
4 bits, 128 for 8), so

    x @ W = MatMulNBits(x; q, s) + blocksum(x) @ ((m - z) * s)

where ``blocksum(x)[t, b]`` sums ``x[t, k]`` over block ``b``: the packed symmetric kernel, plus
a float32 ``[blocks, N]`` offset (as many numbers as the scales) applied by one small MatMul.
The product is the same up to float rounding: the 4 bits of ``q`` and a float scale and offset
per block, as llama.cpp's Q4_1.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _attribute(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def split_float_zero_points(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every MatMulNBits of the main graph whose zero points are a float
    initializer (module doc); returns how many."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    nodes, added, rewritten = [], [], 0
    for node in graph.node:
        zero_points = initializers.get(node.input[3]) if len(node.input) > 3 else None
        if (
            node.op_type != "MatMulNBits"
            or zero_points is None
            or zero_points.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
        ):
            nodes.append(node)
            continue
        k, n = _attribute(node, "K"), _attribute(node, "N")
        bits, block = _attribute(node, "bits"), _attribute(node, "block_size")
        blocks = -(-k // block)
        z = numpy_helper.to_array(zero_points).astype(np.float64).reshape(n, blocks)
        s = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64)
        s = s.reshape(n, blocks)
        default = 2 ** (bits - 1)
        prefix = node.name or node.output[0]
        names = {
            "offsets": f"{prefix}_block_offsets",
            "block_shape": f"{prefix}_block_shape",
            "pads": f"{prefix}_block_pads",
            "axis": f"{prefix}_sum_axis",
        }
        offsets = ((default - z) * s).T.astype(np.float32)
        added += [
            numpy_helper.from_array(offsets, names["offsets"]),
            numpy_helper.from_array(np.array([-1, blocks, block], np.int64), names["block_shape"]),
            numpy_helper.from_array(np.array([2], np.int64), names["axis"]),
        ]
        x, (out,) = node.input[0], node.output
        if len(node.input) > 4:
            raise ValueError(f"{node.name}: MatMulNBits with g_idx or bias and float zero points")
        del node.input[3]
        node.output[0] = f"{prefix}_symmetric"
        nodes.append(node)
        if blocks * block != k:
            pads = np.array([0, 0, 0, blocks * block - k], np.int64)
            added.append(numpy_helper.from_array(pads, names["pads"]))
            nodes.append(helper.make_node("Pad", [x, names["pads"]], [f"{prefix}_x_padded"]))
            x = f"{prefix}_x_padded"
        nodes += [
            helper.make_node("Reshape", [x, names["block_shape"]], [f"{prefix}_x_blocks"]),
            helper.make_node(
                "ReduceSum",
                [f"{prefix}_x_blocks", names["axis"]],
                [f"{prefix}_x_block_sums"],
                keepdims=0,
            ),
            helper.make_node(
                "MatMul", [f"{prefix}_x_block_sums", names["offsets"]], [f"{prefix}_offset"]
            ),
            helper.make_node("Add", [f"{prefix}_symmetric", f"{prefix}_offset"], [out]),
        ]
        graph.initializer.remove(zero_points)
        rewritten += 1
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(added)
    return rewritten
