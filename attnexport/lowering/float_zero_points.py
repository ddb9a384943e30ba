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
default (``offsets="int8"``) they are stored as an 8-bit MatMulNBits stores a weight:
``[N, blocks]`` quantized symmetrically along ``blocks`` (:func:`offset_block_size`). That costs
a rounding of each offset to 8 bits of its column's largest (a weight error ~1/500 of a 4-bit
step's) and saves ~2/3 of their bytes (SmolLM2-135M: 13.3 -> 4.4 MB per token;
docs/quantization.md). The block sums, their product with the offsets and the addition are then
one node, ``attnexport.AddBlockOffsets(y, x, offsets, offset_scales)``: the native kernel
(``ort_kernels/add_block_offsets.cc``) computes them in float32 in one pass, where its function
body below (stock onnxruntime) is a Reshape, a ReduceSum, the dequantized offsets' MatMul and an
Add. float32 offsets keep those standard ops.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.domain_functions import add_function_body
from attnexport.lowering.lm_head import block_quantize
from attnexport.model_contract import DOMAIN

OFFSET_FORMATS = ("float32", "int8")
OP_TYPE = "AddBlockOffsets"


def add_block_offsets_function(opset: int) -> onnx.FunctionProto:
    """The function body of ``attnexport.AddBlockOffsets`` in standard ops of ``opset`` (>= 18):
    ``Z = Y + blocksum(A) @ table``, A ``[..., K]`` summed over blocks of the attribute
    ``block_size`` (zero-padded to whole blocks), ``table[b, n] = offsets[b, n] *
    offset_scales[b // offset_block_size, n]`` (offsets ``[blocks, N]`` int8, offset_scales
    ``[ceil(blocks / offset_block_size), N]`` float32)."""

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
        )

    def attribute(name: str, attribute_name: str) -> list[onnx.NodeProto]:
        """``name``: the int attribute ``attribute_name`` as a 1-D tensor of one value."""
        value = onnx.AttributeProto(name="value_int", type=onnx.AttributeProto.INT)
        value.ref_attr_name = attribute_name
        scalar = helper.make_node("Constant", [], [f"{name}_scalar"])
        scalar.attribute.append(value)
        return [scalar, helper.make_node("Unsqueeze", [f"{name}_scalar", "zero"], [name])]

    nodes = [
        const("zero", [0]),
        const("one", [1]),
        const("minus_one", [-1]),
        const("last", [np.iinfo(np.int64).max]),
        *attribute("block", "block_size"),
        *attribute("offset_block", "offset_block_size"),
        # A's block sums [..., blocks]
        helper.make_node("Shape", ["A"], ["a_shape"]),
        helper.make_node("Slice", ["a_shape", "minus_one", "last"], ["k"]),
        helper.make_node("Shape", ["offsets"], ["offsets_shape"]),  # [blocks, N]
        helper.make_node("Slice", ["offsets_shape", "zero", "one"], ["blocks"]),
        helper.make_node("Mul", ["blocks", "block"], ["padded_k"]),
        helper.make_node("Sub", ["padded_k", "k"], ["pad"]),
        helper.make_node("Concat", ["zero", "pad"], ["pads"], axis=0),
        helper.make_node("Pad", ["A", "pads", "", "minus_one"], ["a_padded"]),
        helper.make_node("Slice", ["a_shape", "zero", "minus_one"], ["leading"]),
        helper.make_node("Concat", ["leading", "blocks", "block"], ["blocked_shape"], axis=0),
        helper.make_node("Reshape", ["a_padded", "blocked_shape"], ["a_blocks"]),
        helper.make_node("ReduceSum", ["a_blocks", "minus_one"], ["sums"], keepdims=0),
        # the table [blocks, N]: each scale row repeated offset_block_size times, cut to blocks
        helper.make_node("Shape", ["offset_scales"], ["scales_shape"]),
        helper.make_node("Unsqueeze", ["offset_scales", "one"], ["scale_rows"]),
        helper.make_node("Slice", ["scales_shape", "zero", "one"], ["scale_count"]),
        helper.make_node("Slice", ["scales_shape", "one", "last"], ["n"]),
        helper.make_node(
            "Concat", ["scale_count", "offset_block", "n"], ["repeated_shape"], axis=0
        ),
        helper.make_node("Expand", ["scale_rows", "repeated_shape"], ["repeated"]),
        helper.make_node("Concat", ["minus_one", "n"], ["flat_shape"], axis=0),
        helper.make_node("Reshape", ["repeated", "flat_shape"], ["scales_per_row"]),
        helper.make_node("Slice", ["scales_per_row", "zero", "blocks"], ["row_scales"]),
        helper.make_node("Cast", ["offsets"], ["offset_floats"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["offset_floats", "row_scales"], ["table"]),
        helper.make_node("MatMul", ["sums", "table"], ["product"]),
        helper.make_node("Add", ["Y", "product"], ["Z"]),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["Y", "A", "offsets", "offset_scales"],
        ["Z"],
        nodes,
        [helper.make_opsetid("", opset)],
        attributes=["block_size", "offset_block_size"],
    )


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
    initializer (module doc), its offsets stored as ``offsets``; returns how many. int8 offsets
    add ``attnexport.AddBlockOffsets``'s function body and the domain's opset import."""
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
        if len(node.input) > 4:
            raise ValueError(f"{node.name}: MatMulNBits with g_idx or bias and float zero points")
        k, n, bits, block = (
            helper.get_node_attr_value(node, name) for name in ("K", "N", "bits", "block_size")
        )
        blocks = -(-k // block)
        z = numpy_helper.to_array(zero_points).astype(np.float64).reshape(n, blocks)
        s = numpy_helper.to_array(initializers[node.input[2]]).astype(np.float64)
        offset_nk = ((2 ** (bits - 1) - z) * s.reshape(n, blocks)).astype(np.float32)
        prefix = node.name or node.output[0]
        x, (out,) = node.input[0], node.output
        del node.input[3]
        node.output[0] = f"{prefix}_symmetric"
        nodes.append(node)
        if offsets == "int8":
            nodes.append(
                _add_block_offsets(f"{prefix}_symmetric", x, out, offset_nk, block, prefix, added)
            )
        else:
            nodes += _float_offsets(
                f"{prefix}_symmetric", x, out, offset_nk, k, block, prefix, added
            )
        graph.initializer.remove(zero_points)
        rewritten += 1
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(added)
    if rewritten and offsets == "int8":
        add_function_body(model, OP_TYPE, add_block_offsets_function)
    return rewritten


def _add_block_offsets(
    y: str,
    x: str,
    out: str,
    offset_nk: np.ndarray,
    block: int,
    prefix: str,
    added: list[onnx.TensorProto],
) -> onnx.NodeProto:
    """``out = y + blocksum(x) @ offset_nk.T`` as ``attnexport.AddBlockOffsets``, the offsets
    rounded to 8 bits (their initializers appended to ``added``)."""
    n, blocks = offset_nk.shape
    offset_block = offset_block_size(blocks)
    packed, scales = block_quantize(offset_nk, 8, offset_block)
    # MatMulNBits' symmetric 8 bits (zero point 128) as int8, [blocks, N] for the kernel's tiles
    centered = (packed.reshape(n, -1)[:, :blocks].astype(np.int16) - 128).astype(np.int8)
    data, scale = f"{prefix}_block_offsets_Q8", f"{prefix}_block_offsets_scales"
    added += [
        numpy_helper.from_array(np.ascontiguousarray(centered.T), data),
        numpy_helper.from_array(np.ascontiguousarray(scales.reshape(n, -1).T), scale),
    ]
    return helper.make_node(
        OP_TYPE,
        [y, x, data, scale],
        [out],
        name=f"{prefix}_offsets",
        domain=DOMAIN,
        block_size=block,
        offset_block_size=offset_block,
    )


def _float_offsets(
    y: str,
    x: str,
    out: str,
    offset_nk: np.ndarray,
    k: int,
    block: int,
    prefix: str,
    added: list[onnx.TensorProto],
) -> list[onnx.NodeProto]:
    """``out = y + blocksum(x) @ offset_nk.T`` in standard ops, the offsets a float32
    initializer (appended to ``added`` with the shapes the nodes read)."""
    blocks = offset_nk.shape[1]
    names = {
        "block_shape": f"{prefix}_block_shape",
        "pads": f"{prefix}_block_pads",
        "axis": f"{prefix}_sum_axis",
        "offsets": f"{prefix}_block_offsets",
    }
    added += [
        numpy_helper.from_array(np.array([-1, blocks, block], np.int64), names["block_shape"]),
        numpy_helper.from_array(np.array([2], np.int64), names["axis"]),
        numpy_helper.from_array(np.ascontiguousarray(offset_nk.T), names["offsets"]),
    ]
    padding = []
    if blocks * block != k:
        pads = np.array([0, 0, 0, blocks * block - k], np.int64)
        added.append(numpy_helper.from_array(pads, names["pads"]))
        padding.append(helper.make_node("Pad", [x, names["pads"]], [f"{prefix}_x_padded"]))
        x = f"{prefix}_x_padded"
    return [
        *padding,
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
        helper.make_node("Add", [y, f"{prefix}_offset"], [out]),
    ]
