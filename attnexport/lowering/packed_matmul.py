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

The lowering rewrites a float32 export's graph (``to_onnx(pack_float_weights=True)``: ``export``
without ``--weights``, target ``attnexport``); :func:`unpack_float_weights` undoes it in a saved
file before its weights are quantized.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

from attnexport.lowering.domain_functions import save_rewritten
from attnexport.model_contract import DOMAIN, DOMAIN_VERSION

OP_TYPE = "PackedMatMul"
PANEL = 32
"""Columns of a panel: the native kernel's register tiles are 32 (AVX2: 4 registers) or 64
(AVX-512: two panels side by side) columns wide."""


def packed_matmul_function(opset: int) -> onnx.FunctionProto:
    """The function body of ``attnexport.PackedMatMul`` in standard ops of ``opset``."""
    nodes = [
        helper.make_node(
            "Constant",
            [],
            ["k_by_rest"],
            value=numpy_helper.from_array(np.array([0, -1], np.int64)),
        ),
        helper.make_node("Transpose", ["B"], ["k_panels"], perm=[1, 0, 2]),  # [K, N/32, 32]
        helper.make_node("Reshape", ["k_panels", "k_by_rest"], ["W"]),  # [K, N]
        helper.make_node("MatMul", ["A", "W"], ["Y"]),
    ]
    return helper.make_function(
        DOMAIN,
        OP_TYPE,
        ["A", "B"],
        ["Y"],
        nodes,
        [helper.make_opsetid("", opset)],
        attributes=["K", "N"],
    )


def to_panels(weight: np.ndarray) -> np.ndarray:
    """``[K, N]`` -> ``[N / 32, K, 32]`` (module doc); ``N`` a multiple of 32."""
    k, n = weight.shape
    return np.ascontiguousarray(weight.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2))


def from_panels(panels: np.ndarray) -> np.ndarray:
    """The inverse of :func:`to_panels`."""
    count, k, _ = panels.shape
    return np.ascontiguousarray(panels.transpose(1, 0, 2).reshape(k, count * PANEL))


TIED_SUFFIX = ".panels"
"""The panels of a tied logits projection, ``Gemm(x, E, transB=1)`` on the embedding table
``E [N, K]`` that a ``Gather`` reads too, are a second initializer ``<E>.panels`` (the table
stays for the ``Gather``: the file and the session hold its 4 x N x K bytes twice)."""


def _float_matrix(value: ir.Value | None) -> bool:
    return (
        value is not None
        and value.is_initializer()
        and not value.is_graph_input()
        and value.const_value is not None
        and value.dtype == ir.DataType.FLOAT
        and len(value.const_value.shape) == 2
    )


def _tied_head(node: ir.Node) -> bool:
    """``Gemm(x, E, transB=1)``, no bias, alpha = beta = 1: the lowering's tied logits
    projection (:func:`attnexport.lowering.onnx_passes.transpose_weights`)."""
    attributes = {name: attribute.value for name, attribute in node.attributes.items()}
    return (
        node.op_type == "Gemm"
        and attributes.get("transB") == 1
        and all(
            attributes.get(name, default) == default
            for name, default in (("transA", 0), ("alpha", 1.0), ("beta", 1.0))
        )
    )


def _panels_of(source, name: str, transposed: bool) -> ir.LazyTensor:
    """The panels of the ``[K, N]`` weight ``source`` (``transposed``: of ``source.T``), computed
    when the file is written."""
    rows, columns = source.shape
    k, n = (columns, rows) if transposed else (rows, columns)

    def compute():
        weight = source.numpy()
        return ir.tensor(to_panels(weight.T if transposed else weight), name=name)

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
        if node.domain not in ("", "ai.onnx") or not _float_matrix(weight):
            continue
        if node.op_type == "MatMul" and len(weight.uses()) == 1:
            k, n = weight.const_value.shape
            if n % PANEL:
                continue
            weight.const_value = _panels_of(weight.const_value, weight.name, transposed=False)
            weight.shape = weight.const_value.shape
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
        node.op_type, node.domain = OP_TYPE, DOMAIN
        node.attributes["K"] = ir.AttrInt64("K", k)
        node.attributes["N"] = ir.AttrInt64("N", n)
        packed += 1
    if packed:
        model.opset_imports[DOMAIN] = DOMAIN_VERSION
        body = ir.serde.deserialize_function(packed_matmul_function(model.opset_imports[""]))
        model.functions[body.identifier()] = body
    return packed


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    """Forgets the recorded shapes of ``names`` (weights whose layout changed)."""
    kept = [v for v in model.graph.value_info if v.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def to_matmul(model: onnx.ModelProto) -> int:
    """The inverse of :func:`pack_float_weights`: every ``PackedMatMul`` back to ``MatMul`` on
    its ``[K, N]`` weight (same name), or to ``Gemm(x, E, transB=1)`` on the table of its tied
    panels (dropped); drops the function body. Returns how many."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
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
    functions = [f for f in model.functions if not (f.domain == DOMAIN and f.name == OP_TYPE)]
    del model.functions[:]
    model.functions.extend(functions)
    return unpacked


def has_packed_matmul(model: onnx.ModelProto) -> bool:
    return any(n.domain == DOMAIN and n.op_type == OP_TYPE for n in model.graph.node)


def unpack_float_weights(path: str | os.PathLike) -> int:
    """:func:`to_matmul` on the ONNX file at ``path``, rewritten in place. Returns the nodes
    rewritten."""
    path = Path(path)
    if not has_packed_matmul(onnx.load(str(path), load_external_data=False)):
        return 0
    model = onnx.load(str(path))
    unpacked = to_matmul(model)
    if unpacked:
        save_rewritten(model, path)
    return unpacked
