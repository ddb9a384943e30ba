"""8-bit weights with finely rounded activations: ``attnexport.MatMul8Bits``.

onnxruntime's CPU ``MatMulNBits`` has two 8-bit paths, neither both fast and faithful: accuracy
level 4 rounds the activations to int8 per block before its integer dot products (SmolLM2-135M:
top-1 agreement with the float model 0.963, where rounding the weights alone gives 0.988), and
level 1 keeps them float32 but dequantizes the whole weight to float32 on every call (14x slower
at decode). ``MatMul8Bits`` keeps MatMulNBits' 8-bit storage (the same initializers: a tied
embedding table stays shared with its ``GatherBlockQuantized``; the scales and float zero points
stored as float16, :func:`_to_float16`) and computes

    Y[..., n] = sum_k A[..., k] * (B[n, k] - zero_point[n, k // block]) * scale[n, k // block]

``B`` is ``[N, blocks, block_size]`` uint8 (``K`` zero-padded to whole blocks), ``scales``
``[N * blocks]`` float16 or float32, ``zero_points`` ``[N * blocks]`` uint8, float16 or float32
(HQQ's fitted zero points, so no offsets are split off:
:mod:`~attnexport.lowering.float_zero_points` is for the MatMulNBits that stay), or one uint8
for every block (128: symmetric). With the attnexport kernels registered, onnxruntime runs the
native kernel (``ort_kernels/matmul_8bits.cc``: A's blocks rounded to int16, 256 times finer
than MatMulNBits' int8, then integer dot products with the weight bytes widened in registers;
a row's numbers independent of the batch); stock onnxruntime inlines the function body below
(standard ops on float32 activations: the weight dequantized, then ``MatMul``), which it folds
into a float32 weight at load.

A projection whose product only a ``SiluAndMul`` or a ``NeoxQKVRotaryEmbedding`` reads joins it
(:func:`fuse_silu_and_mul`, :func:`fuse_qkv_rotary`): the kernel never stores the product.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.domain_functions import add_function_body
from attnexport.model_contract import DOMAIN, DOMAIN_VERSION

OP_TYPE = "MatMul8Bits"
OP_TYPES = {8: OP_TYPE, 4: "MatMul4Bits"}
"""The op of each weight width: ``MatMul4Bits`` is ``MatMul8Bits`` on MatMulNBits' 4-bit
storage (``B [N, blocks, block_size / 2]``, weight ``2j`` of a block in byte ``j``'s low nibble,
``2j + 1`` in its high one), zero points one a byte (not packed two to a byte)."""
FUSED_OP_TYPES = {8: "MatMul8BitsSiluAndMul", 4: "MatMul4BitsSiluAndMul"}
"""``SiluAndMul(MatMul8Bits(A, ...))`` in one node (:func:`fuse_silu_and_mul`): the native
kernel computes a work item's gate and up columns into a scratch and writes ``silu(gate) * up``,
never the ``[..., N]`` product (``N`` a multiple of :data:`FUSED_COLUMNS`)."""
QKV_OP_TYPES = {8: "MatMul8BitsQKVRotary", 4: "MatMul4BitsQKVRotary"}
"""``NeoxQKVRotaryEmbedding(MatMul8Bits(A, ...), cos, sin)`` in one node (:func:`fuse_qkv_rotary`):
the native kernel writes the query and key heads rotated and the value heads in place, never
the ``[..., N]`` product (``head_size`` a multiple of :data:`FUSED_COLUMNS`)."""
QKV_ATTRIBUTES = ("num_heads", "num_kv_heads", "head_size")
FUSED_COLUMNS = 32
"""``N`` of a fused node is a multiple of it: each half a whole number of the kernel's tiles of
16 columns."""
MATMUL_ATTRIBUTES = ("K", "N", "block_size", "batch_invariant", "int8_from_rows")
SYMMETRIC_ZERO_POINTS = {8: "matmul_8bits_zero_point_128", 4: "matmul_4bits_zero_point_8"}
"""The one uint8 zero point (128, or 8 for 4 bits) that every symmetric node reads."""


def matmul_8bits_function(opset: int, bits: int = 8) -> onnx.FunctionProto:
    """The function body of ``attnexport.MatMul8Bits`` (``bits=4``: ``MatMul4Bits``, whose
    body first unpacks the nibbles) in standard ops of ``opset`` (>= 18)."""

    def const(name: str, values: list[int]) -> onnx.NodeProto:
        return helper.make_node(
            "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
        )

    unpack, weights = [], "B"
    if bits == 4:
        weights = "b_bytes"

        def byte(name: str, value: int) -> onnx.NodeProto:
            return helper.make_node(
                "Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.uint8))
            )

        unpack = [
            byte("low_mask", 0x0F),
            byte("nibble_bits", 4),
            const("last_axis", [-1]),
            helper.make_node("BitwiseAnd", ["B", "low_mask"], ["low"]),
            helper.make_node("BitShift", ["B", "nibble_bits"], ["high"], direction="RIGHT"),
            helper.make_node("Unsqueeze", ["low", "last_axis"], ["low_pairs"]),
            helper.make_node("Unsqueeze", ["high", "last_axis"], ["high_pairs"]),
            helper.make_node("Concat", ["low_pairs", "high_pairs"], ["pairs"], axis=-1),
            helper.make_node("Shape", ["B"], ["packed_shape"]),
            helper.make_node("Slice", ["packed_shape", "zero", "two"], ["packed_n_blocks"]),
            helper.make_node(
                "Concat", ["packed_n_blocks", "minus_one"], ["unpacked_shape"], axis=0
            ),
            helper.make_node("Reshape", ["pairs", "unpacked_shape"], [weights]),
        ]
    nodes = [
        const("zero", [0]),
        const("one", [1]),
        const("two", [2]),
        const("minus_one", [-1]),
        const("last", [np.iinfo(np.int64).max]),
        *unpack,
        helper.make_node("Shape", [weights], ["b_shape"]),  # [N, blocks, block_size]
        helper.make_node("Slice", ["b_shape", "zero", "two"], ["n_blocks"]),
        helper.make_node("Concat", ["n_blocks", "one"], ["column_shape"], axis=0),
        helper.make_node("Cast", ["scales"], ["scale_floats"], to=TensorProto.FLOAT),
        helper.make_node("Reshape", ["scale_floats", "column_shape"], ["scale_columns"]),
        helper.make_node("Cast", ["zero_points"], ["zero_floats"], to=TensorProto.FLOAT),
        helper.make_node("Shape", ["scales"], ["scales_shape"]),
        helper.make_node("Expand", ["zero_floats", "scales_shape"], ["zero_each"]),
        helper.make_node("Reshape", ["zero_each", "column_shape"], ["zero_columns"]),
        helper.make_node("Cast", [weights], ["b_floats"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["b_floats", "zero_columns"], ["centered"]),
        helper.make_node("Mul", ["centered", "scale_columns"], ["blocks_nk"]),
        helper.make_node("Slice", ["b_shape", "zero", "one"], ["n"]),
        helper.make_node("Concat", ["n", "minus_one"], ["padded_shape"], axis=0),
        helper.make_node("Reshape", ["blocks_nk", "padded_shape"], ["padded_nk"]),
        helper.make_node("Shape", ["A"], ["a_shape"]),
        helper.make_node("Slice", ["a_shape", "minus_one", "last"], ["k"]),
        helper.make_node("Slice", ["padded_nk", "zero", "k", "one"], ["weight_nk"]),
        helper.make_node("Transpose", ["weight_nk"], ["weight_kn"], perm=[1, 0]),
        helper.make_node("MatMul", ["A", "weight_kn"], ["Y"]),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPES[bits],
        ["A", "B", "scales", "zero_points"],
        ["Y"],
        nodes,
        [helper.make_opsetid("", opset)],
        attributes=list(MATMUL_ATTRIBUTES),
    )


def to_matmul_8bits(
    model: onnx.ModelProto,
    batch_invariant: bool = True,
    bits: tuple[int, ...] = (8,),
    int8_from_rows: int = 0,
) -> int:
    """Rewrites, in place, every ``MatMulNBits`` of the main graph whose weights have one of
    ``bits`` (8, 4) into ``attnexport.MatMul8Bits`` / ``MatMul4Bits`` on the same weights and
    scales (module doc; 4-bit zero points unpacked to one a byte), adding the function bodies
    and the domain's opset import; returns how many. ``batch_invariant=False`` writes the
    attribute ``batch_invariant=0``: the native kernel may then multiply calls of many rows as
    float32 (the weights dequantized into panels), whose numbers differ from the int16 path's.
    ``int8_from_rows > 0`` writes that attribute: the native kernel rounds the activations of a
    call of that many rows or more (a prefill's) to int8 steps instead of int16 ones, and on
    AVX512_VNNI multiplies them with vpdpbusd (~1.45x the products' speed; the numbers of such
    calls, and of the rows decoded in them, are coarser: docs/quantization.md).

    Raises:
        ValueError: a node with ``g_idx`` or a bias (the quantizer writes neither).
    """
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    # A parameter some other node reads as well (a tied table's scales, which the embedding's
    # GatherBlockQuantized needs in the activations' type) keeps float32, its values rounded.
    elsewhere = {
        name
        for node in graph.node
        if not (node.op_type == "MatMulNBits" and helper.get_node_attr_value(node, "bits") in bits)
        for name in node.input
    }
    rewritten: dict[int, int] = {}
    for node in graph.node:
        width = helper.get_node_attr_value(node, "bits") if node.op_type == "MatMulNBits" else 0
        if width not in bits:
            continue
        if len(node.input) > 4:
            raise ValueError(f"{node.name}: MatMulNBits with g_idx or bias")
        if len(node.input) < 4 or not node.input[3]:
            name = SYMMETRIC_ZERO_POINTS[width]
            if name not in initializers:
                initializers[name] = numpy_helper.from_array(
                    np.array([2 ** (width - 1)], np.uint8), name
                )
                graph.initializer.append(initializers[name])
            del node.input[3:]
            node.input.append(name)
        elif width == 4 and initializers[node.input[3]].data_type == TensorProto.UINT8:
            node.input[3] = _unpacked_zero_points(graph, initializers, node)
        for parameters in node.input[2:4]:
            _to_float16(initializers[parameters], keep_float32=parameters in elsewhere)
        node.op_type, node.domain = OP_TYPES[width], DOMAIN
        for index in reversed(range(len(node.attribute))):  # K, N and block_size stay
            if node.attribute[index].name in ("bits", "accuracy_level"):
                del node.attribute[index]
        if not batch_invariant:
            node.attribute.append(helper.make_attribute("batch_invariant", 0))
        if int8_from_rows > 0:
            node.attribute.append(helper.make_attribute("int8_from_rows", int8_from_rows))
        rewritten[width] = rewritten.get(width, 0) + 1
    if not rewritten:
        return 0
    for width in rewritten:
        add_function_body(model, OP_TYPES[width], partial(matmul_8bits_function, bits=width))
    return sum(rewritten.values())


def fuse_silu_and_mul(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every ``MatMul8Bits`` / ``MatMul4Bits`` of the main graph whose product
    only an ``attnexport.SiluAndMul`` reads (not a graph output; ``N`` a multiple of
    :data:`FUSED_COLUMNS`) and that ``SiluAndMul`` into one ``MatMul8BitsSiluAndMul`` /
    ``MatMul4BitsSiluAndMul`` writing the ``SiluAndMul``'s output; adds their function bodies.
    Returns how many. (A prefill of SmolLM2 spent ~5% of its time in ``SiluAndMul``, reading
    and writing the gate/up product from memory.)"""
    graph = model.graph
    fused: dict[int, int] = {}
    for node, width, activation in _projections_read_by(graph, "SiluAndMul"):
        if helper.get_node_attr_value(node, "N") % FUSED_COLUMNS:
            continue
        node.op_type = FUSED_OP_TYPES[width]
        node.output[0] = activation.output[0]
        graph.node.remove(activation)
        fused[width] = fused.get(width, 0) + 1
    for width in fused:
        _add_fused_body(model, FUSED_OP_TYPES[width], width, "SiluAndMul", [], ["Y"], ())
    return sum(fused.values())


FLOAT16_NORMAL = (2.0**-14, 65504.0)
"""The magnitudes float16 holds with its full 11-bit precision."""


def _to_float16(initializer: onnx.TensorProto, keep_float32: bool = False) -> None:
    """Stores a float32 block parameter initializer (scales, hqq's zero points) in place as
    float16, or with ``keep_float32`` as float32 rounded to the nearest float16 values, when every
    nonzero magnitude is a normal float16 (else leaves it): half the bytes a decoded token reads
    of them (a third of a 4-bit layer's at block 32; the native kernel reads its 16-bit copy of
    either), the function body casting them to float32. 2^-11 relative: a 4-bit zero point moves
    by at most 1/256 of a step (docs/quantization.md has the quality). Applied twice (an
    initializer two nodes share), the second call finds float16 values and leaves them."""
    if initializer.data_type != TensorProto.FLOAT:
        return
    values = numpy_helper.to_array(initializer)
    magnitudes = np.abs(values[values != 0])
    low, high = FLOAT16_NORMAL
    if magnitudes.size and (magnitudes.min() < low or magnitudes.max() > high):
        return
    halves = values.astype(np.float16)
    initializer.CopyFrom(
        numpy_helper.from_array(
            halves.astype(np.float32) if keep_float32 else halves, initializer.name
        )
    )


def _unpacked_zero_points(graph: onnx.GraphProto, initializers: dict, node: onnx.NodeProto) -> str:
    """The name of a ``[N * blocks]`` uint8 initializer holding ``node``'s 4-bit zero points one
    a byte (MatMulNBits packs them two to a byte, each column's padded to whole bytes)."""
    n, k, block = (helper.get_node_attr_value(node, a) for a in ("N", "K", "block_size"))
    blocks = -(-k // block)
    packed = numpy_helper.to_array(initializers[node.input[3]]).reshape(n, -1)
    unpacked = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    name = f"{node.input[3]}_unpacked"
    if name not in initializers:
        initializers[name] = numpy_helper.from_array(
            np.ascontiguousarray(unpacked).reshape(-1), name
        )
        graph.initializer.append(initializers[name])
    return name


def _add_fused_body(
    model: onnx.ModelProto,
    op_type: str,
    bits: int,
    after: str,
    after_inputs: list[str],
    outputs: list[str],
    after_attributes: tuple[str, ...],
) -> None:
    """Adds the function body of the fused ``op_type`` to ``model`` (with the bodies it calls,
    where the model lacks them): the two nodes it stands for, ``MatMul8Bits`` (or
    ``MatMul4Bits``) on A, B, scales, zero_points, then ``attnexport.<after>`` on the product and
    ``after_inputs``, writing ``outputs``, with the integer attributes ``after_attributes``; each
    expanded by its own function, attributes passed by reference (one home for either node's
    math)."""
    from attnexport.lowering.registry import onnx_ops

    add_function_body(model, OP_TYPES[bits], partial(matmul_8bits_function, bits=bits))
    add_function_body(
        model, after, lambda opset: ir.serde.serialize_function(onnx_ops()[after].function(opset))
    )

    def body(opset: int) -> onnx.FunctionProto:
        nodes = [
            helper.make_node(
                OP_TYPES[bits], ["A", "B", "scales", "zero_points"], ["product"], domain=DOMAIN
            ),
            helper.make_node(after, ["product", *after_inputs], outputs, domain=DOMAIN),
        ]
        for node, names in ((nodes[0], MATMUL_ATTRIBUTES), (nodes[1], after_attributes)):
            node.attribute.extend(
                helper.make_attribute_ref(name, onnx.AttributeProto.INT) for name in names
            )
        return helper.make_function(
            DOMAIN,
            op_type,
            ["A", "B", "scales", "zero_points", *after_inputs],
            outputs,
            nodes,
            [helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
            attributes=[*MATMUL_ATTRIBUTES, *after_attributes],
        )

    add_function_body(model, op_type, body)


def fuse_qkv_rotary(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every ``MatMul8Bits`` / ``MatMul4Bits`` of the main graph whose product
    only an ``attnexport.NeoxQKVRotaryEmbedding`` reads (not a graph output; ``head_size`` a
    multiple of :data:`FUSED_COLUMNS`) and that node into one ``MatMul8BitsQKVRotary`` /
    ``MatMul4BitsQKVRotary`` writing its three outputs; adds the function bodies (which call the
    two nodes' functions, kept). Returns how many. (A prefill of SmolLM2 spent ~2% of its time
    in the rotation, which read the [T, N] product back from memory.)"""
    graph = model.graph
    fused: dict[int, int] = {}
    for node, width, rotary in _projections_read_by(graph, "NeoxQKVRotaryEmbedding"):
        if len(rotary.input) != 3:
            continue
        geometry = {a.name: a.i for a in rotary.attribute if a.name in QKV_ATTRIBUTES}
        if len(geometry) != 3 or geometry["head_size"] % FUSED_COLUMNS:
            continue
        node.op_type = QKV_OP_TYPES[width]
        node.input.extend(rotary.input[1:])
        del node.output[:]
        node.output.extend(rotary.output)
        node.attribute.extend(helper.make_attribute(k, v) for k, v in geometry.items())
        graph.node.remove(rotary)
        fused[width] = fused.get(width, 0) + 1
    for width in fused:
        _add_fused_body(
            model,
            QKV_OP_TYPES[width],
            width,
            "NeoxQKVRotaryEmbedding",
            ["cos", "sin"],
            ["query", "key", "value"],
            QKV_ATTRIBUTES,
        )
    return sum(fused.values())


def _projections_read_by(
    graph: onnx.GraphProto, op_type: str
) -> list[tuple[onnx.NodeProto, int, onnx.NodeProto]]:
    """``(node, width, reader)`` for every ``MatMul8Bits`` / ``MatMul4Bits`` of ``graph`` whose
    product only the ``attnexport.<op_type>`` node ``reader`` reads, as its first input (the
    product not a graph output); ``width`` the weights' bits."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    widths = {kind: width for width, kind in OP_TYPES.items()}
    found = []
    for node in graph.node:
        width = widths.get(node.op_type) if node.domain == DOMAIN else None
        product = node.output[0]
        if width is None or product in outputs or len(readers.get(product, [])) != 1:
            continue
        (reader,) = readers[product]
        if (reader.domain, reader.op_type) == (DOMAIN, op_type) and reader.input[0] == product:
            found.append((node, width, reader))
    return found
