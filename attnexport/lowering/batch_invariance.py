"""Batch-invariant MatMulNBits: every row computed by the same kernel, whatever the batch.

onnxruntime's CPU MatMulNBits (MLAS) runs a one-row input (``M = 1``: one sequence decoding
alone) through a kernel of its own, whose sums round differently from the kernel that runs
``M >= 2`` rows; between any two ``M >= 2`` the rows agree bit for bit, wherever they sit in the
batch (measured on onnxruntime 1.32, AVX2: docs/quantization.md). With int8 activations
(``accuracy_level`` 4) a last-bit difference can move an activation across a quantization step,
so the greedy tokens of a prompt decoded alone and the same prompt decoded in a batch part ways
(8 of 16 prompts of SmolLM2-135M did).

:func:`pad_matmulnbits_rows` gives each MatMulNBits one more (zero) row than it is asked for,
and drops that row's output: ``M`` is never 1, so one kernel computes every row.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def pad_matmulnbits_rows(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every ``MatMulNBits(A[T, K], ...)`` of the main graph into
    ``Slice(MatMulNBits(Concat(A, zeros[1, K]), ...), rows 0..T)``; returns how many.

    Only 2-D activations are rewritten (attnexport's decoders pack tokens as ``[T, K]``);
    a node whose ``A`` has another rank is left as it is.
    """
    graph = model.graph
    ranks = _ranks(model)
    constants = {
        "row_pad_start": np.array([0], np.int64),
        "row_pad_end": np.array([-1], np.int64),
        "row_pad_axis": np.array([0], np.int64),
    }
    rewritten, nodes = 0, []
    for node in graph.node:
        if node.op_type != "MatMulNBits" or ranks.get(node.input[0]) != 2:
            nodes.append(node)
            continue
        k = next(a.i for a in node.attribute if a.name == "K")
        zeros = f"row_pad_zeros_{k}"
        constants.setdefault(zeros, np.zeros((1, k), np.float32))
        padded_in, padded_out = f"{node.name}_rows_in", f"{node.name}_rows_out"
        (out,) = node.output
        nodes.append(helper.make_node("Concat", [node.input[0], zeros], [padded_in], axis=0))
        node.input[0] = padded_in
        node.output[0] = padded_out
        nodes.append(node)
        nodes.append(
            helper.make_node(
                "Slice", [padded_out, "row_pad_start", "row_pad_end", "row_pad_axis"], [out]
            )
        )
        rewritten += 1
    if rewritten:
        graph.ClearField("node")
        graph.node.extend(nodes)
        graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in constants.items())
    return rewritten


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every value onnx's shape inference knows (graph inputs, outputs and
    intermediate values)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    values = [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    return {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in values
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }
