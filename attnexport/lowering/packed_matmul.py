"""Float32 weights in panels: ``attnexport.PackedMatMul``.

A float32 export's projections (``MatMul(x, W)``, ``W`` a constant ``[K, N]`` initializer) are
stored as panels of 32 columns, ``B [N / 32, K, 32]`` with ``B[p, k, j] = W[k, 32p + j]``, and
computed by ``attnexport.PackedMatMul``: each panel is one contiguous stream that the native
kernel (``ort_kernels/packed_matmul.cc``) reads once per pass of up to 6 rows, every row's
totals in registers. onnxruntime's MatMul (MLAS) packs its own copy of ``W`` at load and runs
it as fast for one row, slower for the 8-64 rows of a batched decode (docs/benchmarks.md).
Stock onnxruntime inlines the function body below (the panels transposed back, then
``MatMul``), which it folds into a ``[K, N]`` weight at load.

Each output is the sum over ``k`` in order, one fused multiply-add at a time, on every path of
the kernel: a row's numbers do not depend on the rows beside it (MLAS's do not either).

A tied logits projection (``Gemm(x, E, transB=1)`` on the embedding table) reads panels of its
own (:data:`TIED_SUFFIX`), and a ``SiluAndMul`` that alone reads a gate/up projection joins it
(``attnexport.PackedMatMulSiluAndMul``, :data:`FUSED_OP_TYPE`).

The lowering rewrites a float32 export's graph (``to_onnx(pack_float_weights=True)``: ``export``
without ``--weights``, target ``attnexport``);
:func:`~attnexport.lowering.lossless_weights.unpack_float_weights` undoes it (and the codes) in a
saved file before its weights are quantized.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from attnexport.lowering.domain_functions import add_used_function_bodies
from attnexport.lowering.onnx_passes import attribute_value, is_constant_matrix, is_standard
from attnexport.model_contract import DOMAIN

OP_TYPE = "PackedMatMul"
FUSED_OP_TYPE = "PackedMatMulSiluAndMul"
"""``SiluAndMul(PackedMatMul(A, B))`` in one node, ``B``'s panels in (gate, up) pairs
(:func:`to_pairs`): the native kernel never stores the gate/up product."""
PANEL = 32
"""Columns of a panel: the native kernel's register tiles are 32 (AVX2: 4 registers) or 64
(AVX-512: two panels side by side) columns wide."""


def _function(op_type: str, nodes: list[onnx.NodeProto], opset: int) -> onnx.FunctionProto:
    return helper.make_function(
        DOMAIN, op_type, ["A", "B"], ["Y"], nodes, [helper.make_opsetid("", opset)], ["K", "N"]
    )


def _const(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
    )


def _product(output: str) -> list[onnx.NodeProto]:
    """``output = A @ W``, W ``[K, N]`` the panels B transposed back."""
    return [
        _const("k_by_rest", [0, -1]),
        helper.make_node("Transpose", ["B"], ["k_panels"], perm=[1, 0, 2]),  # [K, N/32, 32]
        helper.make_node("Reshape", ["k_panels", "k_by_rest"], ["W"]),  # [K, N]
        helper.make_node("MatMul", ["A", "W"], [output]),
    ]


def packed_matmul_function(opset: int) -> onnx.FunctionProto:
    """The function body of ``attnexport.PackedMatMul`` in standard ops of ``opset``."""
    return _function(OP_TYPE, packed_matmul_body(silu_and_mul=False), opset)


def packed_matmul_silu_and_mul_function(opset: int) -> onnx.FunctionProto:
    """The function body of ``attnexport.PackedMatMulSiluAndMul`` in standard ops of ``opset``
    (>= 18): ``PackedMatMul``'s product, its columns in (gate, up) pairs of 32, then
    ``silu(gate) * up`` as ``SiluAndMul``'s body computes it."""
    return _function(FUSED_OP_TYPE, packed_matmul_body(silu_and_mul=True), opset)


def packed_matmul_body(silu_and_mul: bool) -> list[onnx.NodeProto]:
    """The nodes of ``PackedMatMul[SiluAndMul]``'s body: ``Y`` from ``A`` and the panels ``B``
    (opset >= 18)."""
    if not silu_and_mul:
        return _product("Y")
    return [
        *_product("products"),  # [..., N]: g0 u0 g1 u1 ...
        _const("pair", [-1, 2, PANEL]),
        _const("rest", [-1]),
        _const("zero", [0]),
        _const("minus_one", [-1]),
        helper.make_node("Shape", ["A"], ["a_shape"]),
        helper.make_node("Slice", ["a_shape", "zero", "minus_one"], ["lead"]),
        helper.make_node("Concat", ["lead", "pair"], ["pairs_shape"], axis=0),
        helper.make_node("Reshape", ["products", "pairs_shape"], ["pairs"]),
        helper.make_node("Split", ["pairs"], ["gate", "up"], axis=-2, num_outputs=2),
        helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
        helper.make_node("Mul", ["gate", "gate_sigmoid"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["gated"]),
        helper.make_node("Concat", ["lead", "rest"], ["y_shape"], axis=0),
        helper.make_node("Reshape", ["gated", "y_shape"], ["Y"]),
    ]


def to_panels(weight: np.ndarray) -> np.ndarray:
    """``[K, N]`` -> ``[N / 32, K, 32]`` (module doc); ``N`` a multiple of 32."""
    k, n = weight.shape
    return np.ascontiguousarray(weight.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))


def from_panels(panels: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_panels`."""
    count, k, _ = panels.shape
    return np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(k, count * PANEL))


def to_pairs(panels: np.ndarray) -> np.ndarray:
    """The panels (axis 0; any layout of each panel: the lossless codes' too) of a gate/up
    weight ``[K, 2d]`` (the gate's columns first) reordered into (gate, up) pairs: ``g0, u0, g1,
    u1, ...`` (``d`` a multiple of 32)."""
    count = panels.shape[0]
    pairs = panels.reshape(2, count // 2, *panels.shape[1:]).swapaxes(0, 1)
    return np.ascontiguousarray(pairs.reshape(panels.shape))


def from_pairs(pairs: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_pairs`."""
    count = pairs.shape[0]
    panels = pairs.reshape(count // 2, 2, *pairs.shape[1:]).swapaxes(0, 1)
    return np.ascontiguousarray(panels.reshape(pairs.shape))


TIED_SUFFIX = ".panels"
"""The panels of a tied logits projection, ``Gemm(x, E, transB=1)`` on the embedding table
``E [N, K]`` that a ``Gather`` reads too, are a second initializer ``<E>.panels`` (the table
stays for the ``Gather``: the file and the session hold its 4 x N x K bytes twice)."""


def _float_matrix(value: ir.Value | None) -> bool:
    return (
        is_constant_matrix(value)
        and not value.is_graph_input()
        and value.dtype == ir.DataType.FLOAT
    )


def _tied_head(node: ir.Node) -> bool:
    """``Gemm(x, E, transB=1)``, no bias, alpha = beta = 1: the lowering's tied logits
    projection (:func:`attnexport.lowering.onnx_passes.transpose_weights`)."""
    return (
        node.op_type == "Gemm"
        and attribute_value(node, "transB", 0) == 1
        and attribute_value(node, "transA", 0) == 0
        and attribute_value(node, "alpha", 1.0) == 1.0
        and attribute_value(node, "beta", 1.0) == 1.0
    )


def _panels_of(source, name: str, transposed: bool, pairs: bool = False) -> ir.LazyTensor:
    """The panels of the ``[K, N]`` weight ``source`` (``transposed``: of ``source.T``; ``pairs``:
    in gate/up pairs), computed when the file is written."""
    rows, columns = source.shape
    k, n = (columns, rows) if transposed else (rows, columns)

    def compute():
        weight = source.numpy()
        panels = to_panels(weight.T if transposed else weight)
        return ir.tensor(to_pairs(panels) if pairs else panels, name=name)

    return ir.LazyTensor(
        compute, dtype=ir.DataType.FLOAT, shape=ir.Shape((n // PANEL, k, PANEL)), name=name
    )


def pack_float_weights(model: ir.Model) -> int:
    """Rewrites, in place, the main graph's float32 projections into ``attnexport.PackedMatMul``
    (``N`` a multiple of 32): every ``MatMul`` on a ``[K, N]`` initializer that no other node
    reads (the initializer, same name, in panels) and the tied logits projection
    (:data:`TIED_SUFFIX`); the panels are computed when the file is written, one weight at a
    time, as the lowering's transposed weights. Adds the function body and the domain's opset
    import. Returns how many nodes."""
    packed = 0
    for node in list(model.graph):
        weight = node.inputs[1] if len(node.inputs) == 2 else None
        if not is_standard(node, "MatMul", "Gemm") or not _float_matrix(weight):
            continue
        if node.op_type == "MatMul" and len(weight.uses()) == 1:
            k, n = weight.const_value.shape
            if n % PANEL:
                continue
            activation = _silu_and_mul_after(node, n)
            weight.const_value = _panels_of(
                weight.const_value, weight.name, transposed=False, pairs=activation is not None
            )
            weight.shape = weight.const_value.shape
            if activation is not None:
                _absorb(model.graph, node, activation)
        elif _tied_head(node) and len(weight.uses()) > 1:
            n, k = weight.const_value.shape
            if n % PANEL:
                continue
            name = weight.name + TIED_SUFFIX
            panels = _panels_of(weight.const_value, name, transposed=True)
            value = ir.Value(name=name, shape=panels.shape, type=weight.type, const_value=panels)
            model.graph.register_initializer(value)
            node.replace_input_with(1, value)
            node.attributes.clear()
        else:
            continue
        if node.op_type != FUSED_OP_TYPE:
            node.op_type = OP_TYPE
        node.domain = DOMAIN
        node.attributes["K"] = ir.AttrInt64("K", k)
        node.attributes["N"] = ir.AttrInt64("N", n)
        packed += 1
    add_used_function_bodies(
        model,
        {OP_TYPE: packed_matmul_function, FUSED_OP_TYPE: packed_matmul_silu_and_mul_function},
    )
    return packed


def _silu_and_mul_after(node: ir.Node, n: int) -> ir.Node | None:
    """The ``attnexport.SiluAndMul`` that alone reads ``node``'s product (not a graph output),
    when the halves are whole pairs of panels (``n`` a multiple of 64)."""
    product = node.outputs[0]
    uses = list(product.uses())
    if n % (2 * PANEL) or product.is_graph_output() or len(uses) != 1:
        return None
    reader, index = uses[0]
    if (reader.domain, reader.op_type, index) != (DOMAIN, "SiluAndMul", 0):
        return None
    return reader


def _absorb(graph: ir.Graph, node: ir.Node, activation: ir.Node) -> None:
    """Makes ``node`` (a projection) a ``PackedMatMulSiluAndMul`` that writes ``activation``'s
    output (same value name), and removes ``activation``."""
    output, result = activation.outputs[0], node.outputs[0]
    name = output.name
    result.type, result.shape = output.type, output.shape
    ir.convenience.replace_all_uses_with(output, result, replace_graph_outputs=True)
    graph.remove(activation, safe=True)
    result.name = name
    node.op_type = FUSED_OP_TYPE


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    """Forgets the recorded shapes of ``names`` (weights whose layout changed)."""
    kept = [v for v in model.graph.value_info if v.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def to_matmul(model: onnx.ModelProto) -> int:
    """The inverse of :func:`pack_float_weights`: every ``PackedMatMul`` back to ``MatMul`` on
    its ``[K, N]`` weight (same name), or to ``Gemm(x, E, transB=1)`` on the table of its tied
    panels (dropped); drops the function body. Returns how many. (A model with lossless codes
    decodes them first: :func:`~attnexport.lowering.lossless_weights.to_float_matmul`.)"""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    _split_silu_and_mul(model, initializers)
    unpacked, dropped = 0, set()
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type != OP_TYPE:
            continue
        name = node.input[1]
        table = name.removesuffix(TIED_SUFFIX)
        if name.endswith(TIED_SUFFIX) and table in initializers:
            node.input[1] = table
            node.op_type, node.domain = "Gemm", ""
            del node.attribute[:]
            node.attribute.append(helper.make_attribute("transB", 1))
            dropped.add(name)
        else:
            weight = initializers[name]
            matrix = from_panels(numpy_helper.to_array(weight))
            weight.CopyFrom(numpy_helper.from_array(matrix, name))
            node.op_type, node.domain = "MatMul", ""
            del node.attribute[:]
        unpacked += 1
    kept = [i for i in graph.initializer if i.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    _drop_value_info(model, dropped | {n.input[1] for n in graph.node if n.op_type == "MatMul"})
    functions = [
        f
        for f in model.functions
        if not (f.domain == DOMAIN and f.name in (OP_TYPE, FUSED_OP_TYPE))
    ]
    del model.functions[:]
    model.functions.extend(functions)
    return unpacked


def _split_silu_and_mul(model: onnx.ModelProto, initializers: dict) -> None:
    """Every ``PackedMatMulSiluAndMul`` back to ``PackedMatMul`` (its panels out of pairs) and
    the ``SiluAndMul`` after it (the lowering attached ``SiluAndMul``'s function body before it
    fused the nodes, and it stays in the file)."""
    graph = model.graph
    for position in reversed(range(len(graph.node))):
        node = graph.node[position]
        if node.domain != DOMAIN or node.op_type != FUSED_OP_TYPE:
            continue
        weight = initializers[node.input[1]]
        weight.CopyFrom(
            numpy_helper.from_array(from_pairs(numpy_helper.to_array(weight)), weight.name)
        )
        gated = node.output[0]
        product = f"{gated}_gate_up"
        node.op_type, node.output[0] = OP_TYPE, product
        activation = helper.make_node("SiluAndMul", [product], [gated], domain=DOMAIN)
        graph.node.insert(position + 1, activation)
