"""MatMulNBits with float zero points (HQQ), rewritten onto the packed kernels.

HQQ fits a float zero point per block: ``W[k, n] = (q[k, n] - z[b, n]) * s[b, n]`` for ``k`` in
block ``b``. onnxruntime's CPU MatMulNBits takes such zero points but has no packed kernel for
them: it dequantizes the whole weight to float32 on every call (several times slower than the
packed kernels at decode). Without zero points the kernel subtracts its default ``m`` (8 for
4 bits, 128 for 8), so

    x @ W = MatMulNBits(x; q, s) + blocksum(x) @ ((m - z) * s)

where ``blocksum(x)[t, b]`` sums ``x[t, k]`` over block ``b``: the packed symmetric kernel, plus
a float32 ``[blocks, N]`` offset (as many numbers as the scales) applied by one small MatMul.
With ``offsets="float32"`` the product is the same up to float rounding: the 4 bits of ``q``
and a float scale and offset per block, as llama.cpp's Q4_1. The offsets are as many float32
numbers as the scales (0.125 bytes per weight at block 32, a fifth of int4's bytes), so by
default (``offsets="int8"``) they are themselves an 8-bit MatMulNBits: ``[N, blocks]``
quantized symmetrically along ``blocks`` (:func:`offset_block_size`), the block sums its
activations, at the node's own accuracy level. That costs a rounding of each offset to 8 bits
of its column's largest (a weight error ~1/500 of a 4-bit step's) and saves ~2/3 of their
bytes (SmolLM2-135M: 13.3 -> 4.4 MB per token; docs/quantization.md).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
from onnx import helper, numpy_helper

from attnexport.lowering.lm_head import block_quantize
from attnexport.matmul_nbits import matmulnbits_node

OFFSET_FORMATS = ("float32", "int8")


def offset_block_size(blocks: int) -> int:
    """The 8-bit offsets' block along their ``blocks`` rows: the power of 2 >= 16 (MatMulNBits'
    smallest) that stores a column in the fewest bytes (a padded block's bytes plus a float32
    scale per block), the smaller block on a tie (``18 -> 32``, ``48 -> 16``)."""
    sizes = [2**p for p in range(4, max(5, (blocks - 1).bit_length() + 1))]
    return min(sizes, key=lambda b: (-(-blocks // b) * (b + 4), b))


def split_float_zero_points(
    model: onnx.ModelProto, offsets: Literal["float32", "int8"] = "int8"
) -> int:
    """Rewrites, in place, every MatMulNBits of the main graph whose zero points are a float
    initializer (module doc), its offsets stored as ``offsets``; returns how many."""
    if offsets not in OFFSET_FORMATS:
        raise ValueError(f"offsets must be one of {OFFSET_FORMATS}, not {offsets!r}")
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
        k, n, bits, block = (
            helper.get_node_attr_value(node, name) for name in ("K", "N", "bits", "block_size")
        )
        blocks = -(-k // block)
        z = numpy_helper.to_array(zero_points).astype(np.float64).reshape(n, blocks)
        s = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64)
        s = s.reshape(n, blocks)
        default = 2 ** (bits - 1)
        prefix = node.name or node.output[0]
        names = {
            "block_shape": f"{prefix}_block_shape",
            "pads": f"{prefix}_block_pads",
            "axis": f"{prefix}_sum_axis",
        }
        offset_nk = ((default - z) * s).astype(np.float32)
        added += [
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
            *_offset_product(
                f"{prefix}_x_block_sums", offset_nk, f"{prefix}", offsets, node, added
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


def _offset_product(
    block_sums: str,
    offset_nk: np.ndarray,
    prefix: str,
    offsets: str,
    node: onnx.NodeProto,
    added: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """The node(s) computing ``{prefix}_offset = block_sums[T, blocks] @ offset_nk.T`` with the
    offsets stored as ``offsets`` (their initializers appended to ``added``)."""
    if offsets == "float32":
        name = f"{prefix}_block_offsets"
        added.append(numpy_helper.from_array(np.ascontiguousarray(offset_nk.T), name))
        return [helper.make_node("MatMul", [block_sums, name], [f"{prefix}_offset"])]
    n, blocks = offset_nk.shape
    block = offset_block_size(blocks)
    packed, scales = block_quantize(offset_nk, 8, block)
    data, scale = f"{prefix}_block_offsets_Q8", f"{prefix}_block_offsets_scales"
    added += [numpy_helper.from_array(packed, data), numpy_helper.from_array(scales, scale)]
    return [
        matmulnbits_node(
            [block_sums, data, scale],
            f"{prefix}_offset",
            name=f"{prefix}_offsets_Q8",
            k=blocks,
            n=n,
            bits=8,
            block_size=block,
            accuracy_level=helper.get_node_attr_value(node, "accuracy_level"),
        )
    ]
