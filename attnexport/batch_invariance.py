"""Batch-invariant MatMulNBits: every row computed by the same kernel, whatever the batch.

onnxruntime's CPU MatMulNBits (MLAS) runs a one-row input through a kernel of its own, whose
sums round differently from the kernel that runs more rows; it also cuts the rows into tiles of
128 (``StrideM`` in MLAS's ``MlasQNBitGemmBatch``), each tile one call of that choice, so a
batch of 129 rows computes its last row as if alone. With int8 activations (``accuracy_level``
4) a last-bit difference can move an activation across a quantization step, so the greedy
tokens of a prompt decoded alone and the same prompt decoded in a batch part ways (8 of 16
prompts of SmolLM2-135M did). Measured on onnxruntime 1.32, AVX2 (docs/quantization.md):
4-bit weights at either accuracy level and 8-bit at level 1 have the one-row kernel; 8-bit at
level 4 computes every row alike.

:func:`pad_matmulnbits_rows` gives each MatMulNBits one more (zero) row than it is asked for,
and drops that row's output: ``M`` is never 1, and a tile of one row can only be the last
tile holding the zero row alone (``T = 128``: rows 0..127, then the zero row), so one kernel
computes every row that is kept.

The row is not free: on AVX2 an 8-bit MatMulNBits at accuracy level 4 computes two rows in
1.6-2.3x the time of one (SmolLM2's shapes), and it needs no row there, since one MLAS kernel
serves every ``M``. Which kernels do depends on the CPU and onnxruntime build, so the export
keeps every row (stock onnxruntime gets a batch-invariant file) and the runtime drops the rows
that the CPU it runs on does not need: :func:`drop_unneeded_rows` asks
:func:`rows_agree` (a probe of the node's exact kernel: its bits, block size, accuracy level,
zero points and shape, on random data, every row of batches of :data:`PROBE_ROWS` rows against
the same row of the largest, bit for bit) for each padded group.
"""

from __future__ import annotations

import functools
import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from attnexport.matmul_nbits import matmulnbits_node

if TYPE_CHECKING:
    import onnx

# Initializer names of the padding (read by the runtime in the file's bytes, before onnx,
# which the serving core does not import for a model without them).
PAD_ZEROS_PREFIX = "row_pad_zeros_"


def pad_matmulnbits_rows(model: onnx.ModelProto) -> int:
    """Rewrites, in place, every ``MatMulNBits(A[T, K], ...)`` of the main graph into
    ``Slice(MatMulNBits(Concat(A, zeros[1, K]), ...), rows 0..T)``; returns how many.

    Only 2-D activations are rewritten (attnexport's decoders pack tokens as ``[T, K]``);
    a node whose ``A`` has another rank is left as it is.
    """
    from onnx import helper, numpy_helper

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
        zeros = f"{PAD_ZEROS_PREFIX}{k}"
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
    import onnx

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


PROBE_ROWS = (1, 2, 3, 4, 5, 8, 33, 129, 257, 300)
"""The batch sizes :func:`rows_agree` compares, row by row, against the largest (129 and 257:
a last tile of MLAS's 128 rows with one row)."""
PROBE_COLUMNS = 1024
"""At most this many of a projection's output columns are probed."""


@functools.cache
def rows_agree(
    bits: int,
    block_size: int,
    accuracy_level: int,
    k: int,
    n: int,
    zero_points: tuple | None,
    threads: int = 0,
) -> bool:
    """Whether onnxruntime's MatMulNBits of this configuration computes every row bit for bit
    the same in any batch (module doc), on this CPU; probed once per process.

    Args:
        zero_points: the zero-point initializer's ``(onnx dtype, dims)``, or None.
        threads: the session's intra-op threads (0: onnxruntime's default); with one thread
            MLAS computes all rows in one call, with a pool in tiles of 128 rows.
    """
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    # A column's sums do not depend on the others': a slice of a wide projection (a
    # vocabulary's logits) probes its kernel at a fraction of the time.
    columns = min(n, PROBE_COLUMNS)
    blocks = -(-k // block_size)
    inputs = ["x", "b", "s"]
    initializers = [
        numpy_helper.from_array(
            rng.integers(0, 256, (columns, blocks, block_size * bits // 8), dtype=np.uint8), "b"
        ),
        numpy_helper.from_array(rng.uniform(0.001, 0.01, columns * blocks).astype(np.float32), "s"),
    ]
    if zero_points is not None:
        dtype, dims = zero_points
        values = rng.integers(0, 256, int(np.prod(dims)) // n * columns, dtype=np.uint8)
        if dtype != onnx.TensorProto.UINT8:
            values = values.astype(onnx.helper.tensor_dtype_to_np_dtype(dtype)) / 16
        initializers.append(numpy_helper.from_array(values, "z"))
        inputs.append("z")
    node = matmulnbits_node(
        inputs,
        "y",
        k=k,
        n=columns,
        bits=bits,
        block_size=block_size,
        accuracy_level=accuracy_level,
    )
    graph = helper.make_graph(
        [node],
        "rows_agree",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["M", columns])],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    x = rng.standard_normal((max(PROBE_ROWS), k)).astype(np.float32)
    every = session.run(None, {"x": x})[0]
    return all(
        np.array_equal(session.run(None, {"x": x[:m]})[0], every[:m]) for m in PROBE_ROWS[:-1]
    )


def _padded_groups(graph: onnx.GraphProto):
    """``(concat, slice, matmuls)`` per padding row of :func:`pad_matmulnbits_rows`: the
    MatMulNBits nodes that read the padded rows before the Slice that drops the row (the
    projection's; in files exported before ``attnexport.AddBlockOffsets``, also the 8-bit
    offsets' of :mod:`~attnexport.lowering.float_zero_points` over their block sums)."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for concat in graph.node:
        if concat.op_type != "Concat" or not concat.input[-1].startswith(PAD_ZEROS_PREFIX):
            continue
        matmuls, end, frontier, seen = [], None, [concat.output[0]], set()
        while frontier:
            for node in consumers.get(frontier.pop(), []):
                if id(node) in seen:
                    continue
                seen.add(id(node))
                if node.op_type == "Slice" and node.input[1] == "row_pad_start":
                    end = node
                    continue
                if node.op_type == "MatMulNBits":
                    matmuls.append(node)
                frontier.extend(node.output)
        if end is not None and matmuls:
            yield concat, end, matmuls


def _kernel_key(node: onnx.NodeProto, initializers: dict) -> tuple:
    attributes = {a.name: a.i for a in node.attribute}
    zero_points = None
    if len(node.input) > 3 and node.input[3]:
        tensor = initializers[node.input[3]]
        zero_points = (tensor.data_type, tuple(tensor.dims))
    return (
        attributes["bits"],
        attributes["block_size"],
        attributes.get("accuracy_level", 0),
        attributes["K"],
        attributes["N"],
        zero_points,
    )


def drop_unneeded_rows(model: onnx.ModelProto, threads: int = 0) -> int:
    """Removes, in place, the padding of every group whose MatMulNBits kernels all pass
    :func:`rows_agree` on this CPU (the Concat and Slice become Identity, which onnxruntime
    folds away); returns how many groups."""
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    dropped = 0
    for concat, end, matmuls in list(_padded_groups(graph)):
        if not all(rows_agree(*_kernel_key(m, initializers), threads) for m in matmuls):
            continue
        for node, source in ((concat, concat.input[0]), (end, end.input[0])):
            node.op_type = "Identity"
            node.ClearField("attribute")
            node.ClearField("input")
            node.input.append(source)
        dropped += 1
    return dropped


def session_source(path: str | os.PathLike, options) -> str | bytes:
    """What an ``onnxruntime.InferenceSession`` of the model at ``path`` should load: the path
    itself, or, when :func:`drop_unneeded_rows` drops rows here, the rewritten model's bytes
    (``options`` then reads the external weights from the model's folder)."""
    path = Path(path)
    if not _names_padding(path):
        return str(path)
    try:
        import onnx
    except ImportError:  # a serving-only install: the rows stay, the tokens are the same
        return str(path)
    model = onnx.load(str(path), load_external_data=False)
    if not drop_unneeded_rows(model, options.intra_op_num_threads):
        return str(path)
    options.add_session_config_entry(
        "session.model_external_initializers_file_folder_path", str(path.resolve().parent)
    )
    return model.SerializeToString()


def _names_padding(path: Path) -> bool:
    """Whether the ONNX file's bytes hold a padding initializer's name (a protobuf string is
    stored as its bytes): files without one are not parsed."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return False
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return data.find(PAD_ZEROS_PREFIX.encode()) != -1
