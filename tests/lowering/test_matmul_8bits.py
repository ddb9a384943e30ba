"""``attnexport.MatMul8Bits`` (8-bit weights, activations rounded to int16 per block by the
native kernel, float32 in the function body): both against the float64 product of the
dequantized weight, on MatMulNBits' own 8-bit storage (symmetric, uint8 zero points, HQQ's
float zero points), within the int16 rounding's bound; a row's numbers do not depend on its
batch; bad inputs get a named error. And what it is for: MatMulNBits at accuracy level 4 rounds
the activations to int8, 256 times coarser."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.matmul_8bits import OP_TYPE, OP_TYPES, to_matmul_8bits
from tests.helpers import (
    ORT_KERNEL_MODES,
    one_model_session,
    requires_avx512_kernels,
    requires_ort_kernels,
    requires_vnni_kernels,
    rerun_with,
)

ZERO_POINTS = ["symmetric", "uint8", "float32"]
BITS = [8, 4]  # MatMul8Bits, and MatMul4Bits: the same kernel on MatMulNBits' 4-bit storage


def _matmulnbits_model(
    k: int, n: int, block: int, zero_points: str, seed: int = 0, bits: int = 8, float16=True
):
    """A one-node model ``y = MatMulNBits(a)`` with random ``bits``-bit storage at accuracy level
    4, and the float64 ``[n, k]`` weight it stands for. Its scales and float zero points are
    float16 values (``to_matmul_8bits`` rounds them so), or (``float16=False``) one scale is
    too small for a normal float16, so that the node keeps float32 ones."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    q = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
    scales = ((rng.random(n * blocks) + 0.5) * 0.01).astype(np.float16).astype(np.float32)
    if not float16:
        scales = ((rng.random(n * blocks) + 0.5) * 0.01).astype(np.float32)
        scales[0] = 1e-6
    initializers = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scales, "scales")]
    middle = 2 ** (bits - 1)
    zero, stored = np.full(n * blocks, float(middle)), None
    if zero_points == "uint8":
        zero = rng.integers(middle - middle // 4, middle + middle // 4, n * blocks).astype(np.uint8)
        stored = zero
        if bits == 4:  # two to a byte, each column's padded to whole bytes
            columns = np.zeros((n, -(-blocks // 2) * 2), np.uint8)
            columns[:, :blocks] = zero.reshape(n, blocks)
            stored = (columns[:, 0::2] | columns[:, 1::2] << 4).reshape(-1)
    elif zero_points == "float32":
        zero = (rng.random(n * blocks) * middle * 0.5 + middle * 0.75).astype(np.float16)
        zero = zero.astype(np.float32)
        stored = zero
    if stored is not None:
        initializers.append(numpy_helper.from_array(stored, "zero_points"))
    node = helper.make_node(
        "MatMulNBits",
        ["a", "q", "scales", *(["zero_points"] if zero_points != "symmetric" else [])],
        ["y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block,
        accuracy_level=4,
    )
    graph = helper.make_graph(
        [node],
        "matmul",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
        initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    if bits == 4:  # weight 2j in byte j's low nibble, 2j + 1 in its high one
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(n, blocks, block)
    columns = (
        q.astype(np.float64) - zero.astype(np.float64).reshape(n, blocks, 1)
    ) * scales.astype(np.float64).reshape(n, blocks, 1)
    return model, columns.reshape(n, -1)[:, :k]


def _rounding_bound(
    a: torch.Tensor, weight: np.ndarray, block: int, levels: int = 32767
) -> torch.Tensor:
    """``[rows, n]``: the most that rounding each row's blocks of ``a`` to steps of the block's
    largest / ``levels`` (int16: 32767, int8: 127) can move ``a @ weight.T`` (half a step per
    term), plus float32 accumulation (1e-6 of the sum of the terms' magnitudes)."""
    k, n = a.shape[1], weight.shape[0]
    blocks = -(-k // block)
    pad = blocks * block - k
    magnitude = torch.nn.functional.pad(a.double().abs(), (0, pad))
    steps = magnitude.reshape(len(a), blocks, block).amax(-1) / levels
    weights = torch.nn.functional.pad(torch.from_numpy(np.abs(weight)), (0, pad))
    per_block = weights.reshape(n, blocks, block).sum(-1)
    return 0.5 * steps @ per_block.T + 1e-6 * (a.double().abs() @ weights[:, :k].T)


def _fed_as_inputs(model: onnx.ModelProto, prefixes: tuple[str, ...]):
    """A copy of ``model`` whose initializers named with one of ``prefixes`` are graph inputs
    instead (values the graph computes, to the kernel), and their values to feed."""
    fed = onnx.ModelProto()
    fed.CopyFrom(model)
    moved = [i for i in fed.graph.initializer if i.name.startswith(prefixes)]
    for initializer in moved:
        fed.graph.initializer.remove(initializer)
        fed.graph.input.append(
            helper.make_tensor_value_info(
                initializer.name, initializer.data_type, list(initializer.dims)
            )
        )
    return fed, {i.name: numpy_helper.to_array(i) for i in moved}


def _float32_panels(kernels: str, block: int, bits: int) -> bool:
    """Whether a ``batch_invariant = 0`` node multiplies calls of 4 rows or more as float32 here:
    the native kernel's 8-bit blocks over 256, whose sums do not fit the interleaved tiles' int32
    lanes; the tiles are faster than the panels and serve every other node (both variants)."""
    return kernels == "native" and bits == 8 and block > 256


def _matmul_8bits(
    k, n, block, zero_points, kernels, batch_invariant=True, bits=8, float16=True, int8_from_rows=0
):
    model, weight = _matmulnbits_model(k, n, block, zero_points, bits=bits, float16=float16)
    assert to_matmul_8bits(model, batch_invariant, bits=(bits,), int8_from_rows=int8_from_rows) == 1
    assert [(node.domain, node.op_type) for node in model.graph.node] == [
        ("attnexport", OP_TYPES[bits])
    ]
    onnx.checker.check_model(model, full_check=True)
    return one_model_session(model, kernels), weight


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize(
    "k, n, block",
    [(576, 96, 32), (577, 33, 32), (100, 7, 16), (1536, 40, 64), (40, 5, 128)],
)
def test_matches_the_float64_product_of_the_dequantized_weight(
    k, n, block, zero_points, kernels, bits
):
    session, weight = _matmul_8bits(k, n, block, zero_points, kernels, bits=bits)
    a = torch.randn(200, k, generator=torch.Generator().manual_seed(1))
    expected = a.double() @ torch.from_numpy(weight).T
    bound = _rounding_bound(a, weight, block)
    # (8 + 4 + 2 + 1 rows; past a 64-row item; several row blocks, the last one short)
    for rows in (1, 2, 3, 4, 5, 9, 15, 75, 131, 200):
        y = torch.from_numpy(session.run(None, {"a": a[:rows].numpy()})[0])
        error = (y.double() - expected[:rows]).abs()
        assert (error <= bound[:rows]).all(), (error - bound[:rows]).max()


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize("k, n, block", [(576, 96, 32), (577, 33, 32), (1536, 40, 64)])
def test_int8_from_rows_rounds_calls_of_that_many_rows_to_int8_steps(
    k, n, block, zero_points, bits
):
    """Calls of fewer rows are the int16 node's bits; calls of int8_from_rows or more are within
    int8 rounding of the float64 product, and coarser than the int16 node's."""
    int16, weight = _matmul_8bits(k, n, block, zero_points, "native", bits=bits)
    int8, _ = _matmul_8bits(k, n, block, zero_points, "native", bits=bits, int8_from_rows=9)
    a = torch.randn(75, k, generator=torch.Generator().manual_seed(7))
    expected = a.double() @ torch.from_numpy(weight).T
    bound = _rounding_bound(a, weight, block, levels=127)
    for rows in (1, 8, 9, 16, 75):
        feed = {"a": a[:rows].numpy()}
        y, fine = int8.run(None, feed)[0], int16.run(None, feed)[0]
        assert np.array_equal(y, fine) == (rows < 9), rows
        error = (torch.from_numpy(y).double() - expected[:rows]).abs()
        assert (error <= bound[:rows]).all(), (rows, (error - bound[:rows]).max())


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
def test_int8_steps_give_the_same_bits_from_initializers_or_inputs(bits):
    """Initializer weights on AVX512_VNNI multiply int8 steps with vpdpbusd (4 bytes a lane);
    weights the graph computes take the int16 paths: the same integers, so the same bits."""
    model, _ = _matmulnbits_model(577, 70, 32, "float32", bits=bits)
    assert to_matmul_8bits(model, bits=(bits,), int8_from_rows=4) == 1
    fed, values = _fed_as_inputs(model, ("q",))
    a = torch.randn(131, 577, generator=torch.Generator().manual_seed(8)).numpy()
    for rows in (3, 4, 13, 131):
        constant = one_model_session(model, "native").run(None, {"a": a[:rows]})[0]
        computed = one_model_session(fed, "native").run(None, {"a": a[:rows], **values})[0]
        assert np.array_equal(constant, computed), rows


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize("float16", [True, False])
def test_block_parameters_are_stored_as_float16_where_it_holds_them(float16, zero_points, bits):
    """Float32 scales and zero points off float16 values (by 2^-20) are stored as the nearest
    float16 values; scales one of which is below float16's normal range keep float32 (the zero
    points beside them, float16 values, are stored so). Both match the float64 product."""
    model, weight = _matmulnbits_model(577, 40, 32, zero_points, bits=bits, float16=float16)
    floats = [i for i in model.graph.initializer if i.data_type == TensorProto.FLOAT]
    original = {i.name: numpy_helper.to_array(i).copy() for i in floats}
    if float16:
        for i in floats:
            nudged = original[i.name] * np.float32(1 + 2**-20)
            assert not np.array_equal(nudged, original[i.name])
            i.CopyFrom(numpy_helper.from_array(nudged, i.name))
    assert to_matmul_8bits(model, bits=(bits,)) == 1
    stored = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for name, values in original.items():
        kept = not float16 and name == "scales"
        assert stored[name].dtype == (np.float32 if kept else np.float16)
        assert np.array_equal(stored[name].astype(np.float32), values)
    for kernels in ORT_KERNEL_MODES:
        session = one_model_session(model, kernels)
        a = torch.randn(9, 577, generator=torch.Generator().manual_seed(3))
        y = torch.from_numpy(session.run(None, {"a": a.numpy()})[0]).double()
        error = (y - a.double() @ torch.from_numpy(weight).T).abs()
        assert (error <= _rounding_bound(a, weight, 32)).all()


@requires_ort_kernels
def test_parameters_another_node_reads_stay_float32():
    """A tied table's scales are read by the embedding's GatherBlockQuantized too, which needs
    them in the activations' type: they keep float32, rounded to float16 values, and the
    product is the same bits as with float16 ones."""
    model, _ = _matmulnbits_model(577, 40, 32, "float32")
    shared = onnx.ModelProto()
    shared.CopyFrom(model)
    shared.graph.node.append(helper.make_node("Identity", ["scales"], ["scales_out"]))
    shared.graph.output.append(helper.make_tensor_value_info("scales_out", TensorProto.FLOAT, None))
    assert to_matmul_8bits(model) == to_matmul_8bits(shared) == 1
    types = {i.name: i.data_type for i in shared.graph.initializer}
    assert types["scales"] == TensorProto.FLOAT and types["zero_points"] == TensorProto.FLOAT16
    own = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert own["scales"].dtype == np.float16
    a = torch.randn(9, 577, generator=torch.Generator().manual_seed(4)).numpy()
    y, scales = one_model_session(shared, "native").run(None, {"a": a})
    assert np.array_equal(scales, own["scales"].astype(np.float32))
    assert np.array_equal(y, one_model_session(model, "native").run(None, {"a": a})[0])


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
def test_a_row_is_the_same_bits_alone_and_in_any_batch(zero_points, bits):
    session, _ = _matmul_8bits(577, 70, 32, zero_points, "native", bits=bits)
    a = torch.randn(13, 577, generator=torch.Generator().manual_seed(2)).numpy()
    batch = session.run(None, {"a": a})[0]
    for rows in (slice(0, 1), slice(3, 4), slice(2, 5), slice(5, 11), slice(12, 13)):
        assert np.array_equal(session.run(None, {"a": a[rows]})[0], batch[rows])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize(
    "k, n, block", [(576, 96, 32), (577, 33, 32), (100, 7, 16), (40, 5, 128), (1100, 9, 512)]
)
def test_without_batch_invariance_calls_of_many_rows_are_float32_products(
    k, n, block, zero_points, kernels, bits
):
    """``batch_invariant=0``: from 4 rows on, the native kernel multiplies float32 activations by
    the dequantized weights where that path runs (float32 rounding only, far inside the int16
    rounding's bound); fewer rows, and the interleaved tiles, keep the int16 bound."""
    session, weight = _matmul_8bits(
        k, n, block, zero_points, kernels, batch_invariant=False, bits=bits
    )
    a = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    expected = a.double() @ torch.from_numpy(weight).T
    float32_bound = 1e-6 * (a.double().abs() @ torch.from_numpy(np.abs(weight)).T)
    rounding_bound = _rounding_bound(a, weight, block)
    for rows in (1, 3, 4, 5, 9, 70):  # (70: two blocks of rows)
        y = torch.from_numpy(session.run(None, {"a": a[:rows].numpy()})[0])
        error = (y.double() - expected[:rows]).abs()
        panels = rows >= 4 and _float32_panels(kernels, block, bits)
        bound = float32_bound if panels or kernels == "bodies" else rounding_bound
        assert (error <= bound[:rows]).all(), (rows, (error - bound[:rows]).max())


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_the_node_says_batch_invariant_0_only_when_asked(batch_invariant):
    model, _ = _matmulnbits_model(96, 10, 32, "uint8")
    to_matmul_8bits(model, batch_invariant)
    (node,) = model.graph.node
    written = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert written.get("batch_invariant", 1) == int(batch_invariant)


@requires_ort_kernels
def test_without_batch_invariance_a_row_is_the_same_bits_in_any_call_of_4_rows_or_more():
    session, _ = _matmul_8bits(1100, 70, 512, "uint8", "native", batch_invariant=False)
    a = torch.randn(131, 1100, generator=torch.Generator().manual_seed(4)).numpy()
    batch = session.run(None, {"a": a})[0]
    for rows in (slice(0, 4), slice(3, 8), slice(2, 11), slice(60, 70), slice(1, 131)):
        assert np.array_equal(session.run(None, {"a": a[rows]})[0], batch[rows])
    invariant, _ = _matmul_8bits(1100, 70, 512, "uint8", "native")
    same_path = not _float32_panels("native", 512, 8)
    assert np.array_equal(invariant.run(None, {"a": a})[0], batch) == same_path


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_activations_are_rounded_finer_than_int8(kernels):
    """An activation block with one large value: MatMulNBits at accuracy level 4 rounds the
    small ones to int8 steps of that block's largest (the error that cost the 8-bit export its
    top-1 agreement: here the small values vanish); MatMul8Bits to int16 steps (native: 256
    times finer) or not at all (the body)."""
    k, n = 256, 64
    model, weight = _matmulnbits_model(k, n, 32, "symmetric")
    a = torch.randn(2, k, generator=torch.Generator().manual_seed(3)) * 0.01
    a[:, ::32] = 30.0  # one outlier per block
    expected = a.double() @ torch.from_numpy(weight).T

    def error(session):
        return (torch.from_numpy(session.run(None, {"a": a.numpy()})[0]) - expected).abs().max()

    int8_activations = error(one_model_session(model, "bodies"))
    assert to_matmul_8bits(model) == 1
    int16_activations = error(one_model_session(model, kernels))
    assert int16_activations < int8_activations / 20, (int16_activations, int8_activations)
    assert int16_activations <= _rounding_bound(a, weight, 32).max()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_activation_makes_its_row_nan_and_no_other(kernels, bad, bits):
    """int16 steps have no NaN or infinity: the kernel must not round one into a finite number
    (float32 arithmetic, the body's, gives NaN or infinities: every output of the row is
    non-finite either way)."""
    for batch_invariant, rows in ((True, 3), (False, 5)):  # (5 rows: the float32 panels)
        session, _ = _matmul_8bits(96, 10, 32, "float32", kernels, batch_invariant, bits)
        a = torch.randn(rows, 96, generator=torch.Generator().manual_seed(4)).numpy()
        a[1, 40] = bad
        y = session.run(None, {"a": a})[0]
        assert not np.isfinite(y[1]).any()
        assert np.isfinite(np.delete(y, 1, axis=0)).all()


@requires_ort_kernels
@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"q": np.zeros((4, 2, 16), np.int8)},
            r"MatMul8Bits: b: expected uint8 \[4, 2, 16\], got int8",
        ),
        ({"q": np.zeros((4, 2, 8), np.uint8)}, "MatMul8Bits: b: expected uint8"),
        (
            {"scales": np.zeros(7, np.float32)},
            r"MatMul8Bits: scales: expected float32 or float16 \[8\]",
        ),
        ({"zero_points": np.zeros(3, np.uint8)}, "MatMul8Bits: zero_points: expected"),
        ({"zero_points": np.zeros(8, np.int32)}, "MatMul8Bits: zero_points: expected"),
    ],
)
def test_bad_inputs_get_a_named_error(change, message):
    inputs = {
        "q": np.zeros((4, 2, 16), np.uint8),
        "scales": np.ones(8, np.float32),
        "zero_points": np.full(8, 128, np.uint8),
    } | change
    node = helper.make_node(
        OP_TYPE,
        ["a", "q", "scales", "zero_points"],
        ["y"],
        domain="attnexport",
        K=20,
        N=4,
        block_size=16,
    )
    graph = helper.make_graph(
        [node],
        "bad",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(v, name) for name, v in inputs.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("attnexport", 1)]
    )
    model.ir_version = 10
    with pytest.raises(Exception, match=message):
        one_model_session(model, "native").run(None, {"a": np.ones((1, 20), np.float32)})


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [256, 512, 1024])
def test_the_largest_sums_of_the_longest_blocks_are_exact(block, bits):
    """Every weight at its largest byte and every activation equal (each rounded to 32767): a
    column's block sum is block * 32767 * 255 at 8 bits, past int32 from blocks of 512 (the
    AVX-512 path summed a whole block in one lane and returned the negated product)."""
    k, n = 1024, 20
    model, _ = _matmulnbits_model(k, n, block, "symmetric", bits=bits)
    largest = np.full(numpy_helper.to_array(model.graph.initializer[0]).shape, 255, np.uint8)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(largest, "q"))
    scales = numpy_helper.to_array(model.graph.initializer[1]).astype(np.float64).reshape(n, -1)
    assert to_matmul_8bits(model, bits=(bits,)) == 1
    session = one_model_session(model, "native")
    y = session.run(None, {"a": np.ones((5, k), np.float32)})[0]
    largest_weight = 2**bits - 1 - 2 ** (bits - 1)
    expected = largest_weight * block * scales.sum(1)
    np.testing.assert_allclose(y, np.broadcast_to(expected, y.shape), rtol=1e-5)


@requires_ort_kernels
def test_a_block_too_long_for_exact_int32_sums_is_refused():
    """A block's int32 lane sums are exact up to 1024 weights (64 pairs of 32767 * 255 a lane)."""
    model, _ = _matmulnbits_model(4096, 4, 2048, "symmetric")
    assert to_matmul_8bits(model) == 1
    with pytest.raises(
        Exception, match="multiple of 16 up to 1024, got K=4096, N=4, block_size=2048"
    ):
        one_model_session(model, "native")


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize("k, n, block", [(577, 70, 32), (1536, 40, 64)])
def test_block_parameters_from_initializers_or_inputs_give_the_same_bits(
    k, n, block, zero_points, bits
):
    """The AVX-512 variant copies initializer scales and zero points into its lanes' layout when
    the session is made, and transposes them on every call otherwise (scales a graph computes):
    the same numbers, one row or many."""
    model, _ = _matmulnbits_model(k, n, block, zero_points, bits=bits)
    assert to_matmul_8bits(model, bits=(bits,)) == 1
    fed, values = _fed_as_inputs(model, ("scales", "zero_points"))
    a = torch.randn(13, k, generator=torch.Generator().manual_seed(5)).numpy()
    for rows in (1, 2, 13):
        constant = one_model_session(model, "native").run(None, {"a": a[:rows]})[0]
        computed = one_model_session(fed, "native").run(None, {"a": a[:rows], **values})[0]
        assert np.array_equal(constant, computed)


@requires_ort_kernels
def test_invalid_initializer_parameters_of_a_wide_block_get_the_named_error():
    """Initializers that do not fit the node are left alone when the session is made (no copy)
    and named when it runs, as for any other block size."""
    model, _ = _matmulnbits_model(64, 4, 32, "float32")
    assert to_matmul_8bits(model) == 1
    (scales,) = [i for i in model.graph.initializer if i.name == "scales"]
    scales.CopyFrom(numpy_helper.from_array(np.ones(7, np.float32), "scales"))
    with pytest.raises(Exception, match=r"MatMul8Bits: scales: expected float32 or float16 \[8\]"):
        one_model_session(model, "native").run(None, {"a": np.ones((1, 64), np.float32)})


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    """This CPU runs the AVX-512 variant by default; the AVX2 one has integer and panel paths
    of its own."""
    rerun_with(__file__, "avx2_variant", ATTNEXPORT_ISA="avx2")


@requires_vnni_kernels
def test_without_vnni_these_tests_pass_too():
    """On this CPU the integer path of 4 rows or more multiplies with vpdpwssd; without it
    (ATTNEXPORT_VNNI=0), with vpmaddwd and vpaddd."""
    rerun_with(__file__, "avx2_variant or without_vnni", ATTNEXPORT_VNNI="0")


@pytest.mark.parametrize(
    "other",
    [
        pytest.param({"ATTNEXPORT_VNNI": "0"}, id="without-vnni", marks=requires_vnni_kernels),
        pytest.param({"ATTNEXPORT_ISA": "avx2"}, id="avx2", marks=requires_avx512_kernels),
    ],
)
@pytest.mark.parametrize("int8_from_rows", [0, 4])
@pytest.mark.parametrize("bits", BITS)
def test_other_instruction_paths_give_the_same_bits(bits, int8_from_rows, other, tmp_path):
    """vpdpwssd sums the same integers as vpmaddwd and vpaddd, and vpdpbusd on int8 steps
    (int8_from_rows) the same as the int16 tiles on them: the outputs of a process without
    AVX512_VNNI equal this one's bit for bit. So do the AVX2 variant's, whose rows are rounded
    8 lanes at a time where the AVX-512 one takes a block of 16s in one pass (the last, partial
    block of K = 577 by both one value at a time)."""
    session, _ = _matmul_8bits(
        577, 70, 32, "float32", "native", bits=bits, int8_from_rows=int8_from_rows
    )
    a = torch.randn(37, 577, generator=torch.Generator().manual_seed(6)).numpy()
    np.save(tmp_path / "a.npy", a)
    script = (
        "import sys, numpy as np\n"
        "from tests.lowering.test_matmul_8bits import _matmul_8bits\n"
        f"session, _ = _matmul_8bits(577, 70, 32, 'float32', 'native', bits={bits}, "
        f"int8_from_rows={int8_from_rows})\n"
        "np.save(sys.argv[2], session.run(None, {'a': np.load(sys.argv[1])})[0])\n"
    )
    env = {**os.environ, **other}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.npy"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "y.npy"), session.run(None, {"a": a})[0])
