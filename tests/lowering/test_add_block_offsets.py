"""``attnexport.AddBlockOffsets`` (the offsets half of a MatMulNBits with HQQ's float zero points):
the native kernel and the function body against the float64 sum, over row counts, K not a
multiple of the block, N not a multiple of the kernel's tile and every offset grouping; a row's
numbers do not depend on its batch; bad inputs get a named error before any arithmetic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.float_zero_points import OP_TYPE, add_block_offsets_function
from attnexport.model_contract import DOMAIN, DOMAIN_VERSION
from tests.helpers import (
    ORT_KERNEL_MODES,
    one_model_session,
    requires_avx512_kernels,
    requires_ort_kernels,
    rerun_with,
)


def _model(
    k: int, n: int, block: int, offset_block: int, seed: int = 0, **overrides: np.ndarray
) -> tuple[onnx.ModelProto, np.ndarray]:
    """A one-node model ``z = AddBlockOffsets(y, a, offsets, offset_scales)`` with random
    offsets (or ``overrides``), and the float64 ``[blocks, n]`` table they stand for (None with
    ``overrides``)."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    offsets = rng.integers(-127, 128, (blocks, n), dtype=np.int8)
    scales = ((rng.random((-(-blocks // offset_block), n)) + 0.5) * 0.01).astype(np.float32)
    offsets, scales = overrides.get("offsets", offsets), overrides.get("scales", scales)
    node = helper.make_node(
        OP_TYPE,
        ["y", "a", "offsets", "scales"],
        ["z"],
        domain=DOMAIN,
        block_size=block,
        offset_block_size=offset_block,
    )
    graph = helper.make_graph(
        [node],
        "offsets",
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "columns"]),
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k]),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["rows", n])],
        [numpy_helper.from_array(offsets, "offsets"), numpy_helper.from_array(scales, "scales")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)],
        functions=[add_block_offsets_function(18)],
    )
    model.ir_version = 10
    if overrides:
        return model, None
    row_scales = np.repeat(scales.astype(np.float64), offset_block, axis=0)[:blocks]
    return model, offsets.astype(np.float64) * row_scales


def _inputs(rows: int, k: int, n: int, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "y": rng.standard_normal((rows, n)).astype(np.float32),
        "a": rng.standard_normal((rows, k)).astype(np.float32),
    }


def _expected(
    feeds: dict[str, np.ndarray], table: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray]:
    """The float64 ``z``, and the sum of its terms' magnitudes (for float32's rounding)."""
    a = feeds["a"].astype(np.float64)
    blocks = table.shape[0]
    padded = np.pad(a, ((0, 0), (0, blocks * block - a.shape[1])))
    sums = padded.reshape(len(a), blocks, block).sum(-1)
    return feeds["y"].astype(np.float64) + sums @ table, np.abs(padded).reshape(
        len(a), blocks, block
    ).sum(-1) @ np.abs(table)


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize(
    "k, n, block, offset_block",
    [
        (576, 3072, 32, 32),
        (1536, 576, 32, 16),
        (100, 70, 32, 16),
        (577, 129, 32, 1),
        (40, 5, 128, 64),
    ],
)
def test_matches_the_float64_sum(k, n, block, offset_block, kernels):
    model, table = _model(k, n, block, offset_block)
    onnx.checker.check_model(model, full_check=True)
    session = one_model_session(model, kernels)
    for rows in (0, 1, 2, 3, 5, 70):
        feeds = _inputs(rows, k, n)
        (z,) = session.run(None, feeds)
        expected, magnitude = _expected(feeds, table, block)
        assert z.shape == (rows, n)
        # float32 sums of float32 products: a few ulps of the terms' magnitudes
        bound = 1e-6 * (magnitude + np.abs(feeds["y"])) + 1e-30
        assert (np.abs(z - expected) <= bound).all(), (rows, (np.abs(z - expected) - bound).max())


@requires_ort_kernels
def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    """Calls of one or two rows dequantize the offsets as they read them; more rows read a
    dequantized tile: the same products in the same order."""
    session = one_model_session(_model(577, 200, 32, 16)[0], "native")
    feeds = _inputs(131, 577, 200, seed=2)
    (batch,) = session.run(None, feeds)
    for rows in (slice(0, 1), slice(3, 5), slice(2, 5), slice(5, 11), slice(1, 131)):
        (z,) = session.run(None, {name: value[rows] for name, value in feeds.items()})
        assert np.array_equal(z, batch[rows])


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_a_non_finite_activation_spoils_its_row_and_no_other(kernels):
    session = one_model_session(_model(96, 70, 32, 16)[0], kernels)
    feeds = _inputs(4, 96, 70)
    feeds["a"][2, 40] = np.inf
    (z,) = session.run(None, feeds)
    assert not np.isfinite(z[2]).any()  # +-inf, or nan where an offset is 0
    assert np.isfinite(np.delete(z, 2, axis=0)).all()


@requires_ort_kernels
@pytest.mark.parametrize(
    "overrides, feeds, message",
    [
        ({"offsets": np.zeros((4, 70), np.int8)}, {}, "offsets: expected 3 rows"),
        ({"scales": np.ones((2, 70), np.float32)}, {}, "offset_scales: expected [1, 70]"),
        ({"offsets": np.zeros((3, 70), np.uint8)}, {}, "offsets int8, got"),
        ({}, {"y": np.zeros((2, 69), np.float32)}, "y: expected [2, 70]"),
    ],
)
def test_bad_inputs_get_a_named_error(overrides, feeds, message):
    model, _ = _model(96, 70, 32, 32, **overrides)
    session = one_model_session(model, "native")
    inputs = {**_inputs(2, 96, 70), **feeds}
    with pytest.raises(Exception, match="AddBlockOffsets") as error:
        session.run(None, inputs)
    assert message in str(error.value)


@requires_ort_kernels
def test_a_slice_of_the_output_of_padded_rows_loads(tmp_path):
    """The node's inputs a batch-invariance row longer (a Concat: a rows dim without a name) and
    a Slice of its output: onnxruntime 1.32 aborted the process while loading this when the
    kernel's shape inference passed the unnamed dim on as it was (fixed size -1). In a child
    process, so that an abort fails this test rather than the run."""
    model, _ = _model(96, 70, 32, 32)
    graph = model.graph
    graph.initializer.extend(
        [
            numpy_helper.from_array(np.zeros((1, 70), np.float32), "y_zeros"),
            numpy_helper.from_array(np.zeros((1, 96), np.float32), "a_zeros"),
            numpy_helper.from_array(np.array([0], np.int64), "start"),
            numpy_helper.from_array(np.array([-1], np.int64), "end"),
        ]
    )
    (node,) = graph.node
    node.input[0], node.input[1], node.output[0] = "y_padded", "a_padded", "z_padded"
    graph.node.extend(
        [
            helper.make_node("Concat", ["y", "y_zeros"], ["y_padded"], axis=0),
            helper.make_node("Concat", ["a", "a_zeros"], ["a_padded"], axis=0),
            helper.make_node("Slice", ["z_padded", "start", "end", "start"], ["z"]),
        ]
    )
    nodes = list(graph.node)
    graph.ClearField("node")
    graph.node.extend([*nodes[1:3], nodes[0], nodes[3]])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(tmp_path / "padded.onnx"))
    script = (
        "import sys, numpy as np\n"
        "from tests.helpers import one_model_session\n"
        "import onnx\n"
        "session = one_model_session(onnx.load(sys.argv[1]), 'native')\n"
        "feeds = {'y': np.ones((3, 70), np.float32), 'a': np.ones((3, 96), np.float32)}\n"
        "assert session.run(None, feeds)[0].shape == (3, 70)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "padded.onnx")],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    """This CPU runs the AVX-512 variant by default; the AVX2 one reads the table a row at a
    time."""
    rerun_with(__file__, "avx2_variant", ATTNEXPORT_ISA="avx2")
