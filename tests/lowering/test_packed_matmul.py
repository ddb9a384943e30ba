"""``attnexport.PackedMatMul`` (float32 weights in panels of 32 columns): the native kernel and
the function body against the float64 product over parametrized shapes and row counts (every
pass of rows and panels of both kernel variants); a row's numbers do not depend on its batch,
nor on the kernel variant; bad inputs get a named error; the rewrite and its inverse."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.packed_matmul import (
    FUSED_OP_TYPE,
    OP_TYPE,
    from_panels,
    pack_float_weights,
    to_matmul,
    to_panels,
)
from attnexport.model_contract import DOMAIN
from tests.helpers import (
    ORT_KERNEL_MODES,
    one_model_session,
    requires_avx512_kernels,
    requires_ort_kernels,
    rerun_with,
)


def _matmul_model(k: int, n: int, seed: int = 0, readers: int = 1):
    """A model ``y = MatMul(a, W)`` (``readers=2``: and ``z = Identity(W)``) with a random float32
    ``W [k, n]``, and ``W``."""
    weight = torch.randn(k, n, generator=torch.Generator().manual_seed(seed)).numpy()
    nodes = [helper.make_node("MatMul", ["a", "W"], ["y"], name="proj")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])]
    if readers == 2:
        nodes.append(helper.make_node("Identity", ["W"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [k, n]))
    graph = helper.make_graph(
        nodes,
        "matmul",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["rows", k])],
        outputs,
        [numpy_helper.from_array(weight, "W")],
        value_info=[helper.make_tensor_value_info("W", TensorProto.FLOAT, [k, n])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model, weight


def to_packed_matmul(model: onnx.ModelProto) -> int:
    """:func:`pack_float_weights` on a proto, in place; returns its count."""
    graph = ir.from_proto(model)
    packed = pack_float_weights(graph)
    model.CopyFrom(ir.to_proto(graph))
    return packed


def _packed(k: int, n: int, kernels: str, seed: int = 0):
    model, weight = _matmul_model(k, n, seed)
    assert to_packed_matmul(model) == 1
    return one_model_session(model, kernels), weight


def _float32_bound(a: torch.Tensor, weight: np.ndarray) -> torch.Tensor:
    """float32 accumulation over k terms: k * 2^-24 of the sum of the terms' magnitudes."""
    k = a.shape[1]
    return k * 2.0**-24 * (a.double().abs() @ torch.from_numpy(np.abs(weight)).double())


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 64), (37, 32), (100, 96), (1, 160)])
def test_the_product_is_the_float64_product_within_float32_rounding(k, n, kernels):
    """Row counts cover every pass of rows (1-6 at a time, AVX2 1-2), a row block's end (96)
    and two blocks; widths one panel, an odd count (a last single panel) and even ones."""
    session, weight = _packed(k, n, kernels)
    a = torch.randn(200, k, generator=torch.Generator().manual_seed(1))
    expected = a.double() @ torch.from_numpy(weight).double()
    bound = _float32_bound(a, weight)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13, 32, 96, 97, 200):
        y = torch.from_numpy(session.run(None, {"a": a[:rows].numpy()})[0])
        assert y.shape == (rows, n)
        error = (y.double() - expected[:rows]).abs()
        assert (error <= bound[:rows]).all(), (rows, (error - bound[:rows]).max())


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_leading_dims_and_zero_rows(kernels):
    model, weight = _matmul_model(64, 96)
    model.graph.input[0].type.tensor_type.shape.dim.insert(0, onnx.TensorShapeProto.Dimension())
    model.graph.output[0].type.tensor_type.shape.dim.insert(0, onnx.TensorShapeProto.Dimension())
    to_packed_matmul(model)
    session = one_model_session(model, kernels)
    a = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2)).numpy()
    y = session.run(None, {"a": a})[0]
    assert y.shape == (2, 3, 96)
    np.testing.assert_allclose(y, a @ weight, rtol=1e-5, atol=1e-4)
    assert session.run(None, {"a": np.zeros((0, 2, 64), np.float32)})[0].shape == (0, 2, 96)


@requires_ort_kernels
def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    session, _ = _packed(576, 160, "native")
    a = torch.randn(200, 576, generator=torch.Generator().manual_seed(3)).numpy()
    batch = session.run(None, {"a": a})[0]
    for rows in (slice(0, 1), slice(5, 6), slice(2, 9), slice(90, 100), slice(1, 200)):
        assert np.array_equal(session.run(None, {"a": a[rows]})[0], batch[rows])


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    """This CPU runs the AVX-512 variant by default; the AVX2 one has tiles of its own."""
    rerun_with(__file__, "avx2_variant or same_bits_on", ATTNEXPORT_ISA="avx2")


@requires_avx512_kernels
def test_a_row_is_the_same_bits_on_the_avx2_variant(tmp_path):
    """Both variants sum each output over k in order, one fused multiply-add at a time."""
    session, _ = _packed(576, 160, "native")
    a = torch.randn(37, 576, generator=torch.Generator().manual_seed(4)).numpy()
    np.save(tmp_path / "a.npy", a)
    script = (
        "import sys, numpy as np\n"
        "from tests.lowering.test_packed_matmul import _packed\n"
        "session, _ = _packed(576, 160, 'native')\n"
        "np.save(sys.argv[2], session.run(None, {'a': np.load(sys.argv[1])})[0])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "a.npy"), str(tmp_path / "y.npy")],
        capture_output=True,
        text=True,
        env={**os.environ, "ATTNEXPORT_ISA": "avx2"},
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "y.npy"), session.run(None, {"a": a})[0])


@requires_ort_kernels
@pytest.mark.parametrize(
    "feed, message",
    [
        (np.ones((2, 63), np.float32), r"got float32 \[2, 63\]"),
        (np.ones((2, 64), np.float16), r"got float16 \[2, 64\]"),
    ],
)
def test_bad_activations_get_a_named_error(feed, message):
    model, _ = _matmul_model(64, 96)
    to_packed_matmul(model)
    model.graph.input[0].type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(feed.dtype)
    del model.graph.input[0].type.tensor_type.shape.dim[:]
    model.graph.output[0].type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(feed.dtype)
    expected = r"PackedMatMul: a: expected float32 \[\.\.\., 64\], "
    with pytest.raises(Exception, match=expected + message):
        one_model_session(model, "native").run(None, {"a": feed})


@requires_ort_kernels
def test_panels_that_do_not_fit_the_attributes_get_a_named_error():
    model, _ = _matmul_model(64, 96)
    to_packed_matmul(model)
    (node,) = model.graph.node
    for attribute in node.attribute:
        if attribute.name == "N":
            attribute.i = 128
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 128
    expected = r"PackedMatMul: b: expected float32 \[4, 64, 32\], got float32 \[3, 64, 32\]"
    with pytest.raises(Exception, match=expected):
        one_model_session(model, "native").run(None, {"a": np.ones((1, 64), np.float32)})


def test_the_rewrite_packs_only_float32_weights_read_once_and_32_columns_wide():
    packed, weight = _matmul_model(48, 96)
    assert to_packed_matmul(packed) == 1
    (node,) = packed.graph.node
    assert (node.domain, node.op_type) == (DOMAIN, OP_TYPE)
    assert {a.name: a.i for a in node.attribute} == {"K": 48, "N": 96}
    (panels,) = packed.graph.initializer
    assert panels.name == "W" and list(panels.dims) == [3, 48, 32]
    assert np.array_equal(numpy_helper.to_array(panels)[1, 5], weight[5, 32:64])
    for recorded in [v for v in packed.graph.value_info if v.name == "W"]:
        assert [d.dim_value for d in recorded.type.tensor_type.shape.dim] == [3, 48, 32]
    onnx.checker.check_model(packed, full_check=True)
    assert to_packed_matmul(_matmul_model(48, 100)[0]) == 0  # not 32 columns wide
    assert to_packed_matmul(_matmul_model(48, 96, readers=2)[0]) == 0  # W read elsewhere


def test_unpacking_gives_back_the_model():
    model, weight = _matmul_model(48, 96)
    to_packed_matmul(model)
    assert to_matmul(model) == 1
    (node,) = model.graph.node
    assert (node.domain, node.op_type, list(node.attribute)) == ("", "MatMul", [])
    assert np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), weight)
    assert not model.functions
    w = np.arange(6 * 64, dtype=np.float32).reshape(6, 64)
    assert np.array_equal(from_panels(to_panels(w)), w)


def _tied_model(vocab: int = 96, hidden: int = 40):
    """``logits = Gemm(Gather(E, ids), E, transB=1)`` (a tied embedding table ``E [vocab,
    hidden]``), and ``E``."""
    table = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(7)).numpy()
    nodes = [
        helper.make_node("Gather", ["E", "ids"], ["x"]),
        helper.make_node("Gemm", ["x", "E"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["rows"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", vocab])],
        [numpy_helper.from_array(table, "E")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model, table


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_a_tied_logits_projection_reads_panels_of_its_own(kernels):
    """The table stays for the Gather; the Gemm reads ``E.panels``, and turns back into it."""
    model, table = _tied_model()
    assert to_packed_matmul(model) == 1
    names = sorted(i.name for i in model.graph.initializer)
    assert names == ["E", "E.panels"]
    ids = np.array([0, 5, 95], np.int64)
    logits = one_model_session(model, kernels).run(None, {"ids": ids})[0]
    expected = table[ids].astype(np.float64) @ table.T.astype(np.float64)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-4)
    assert to_matmul(model) == 1
    assert [i.name for i in model.graph.initializer] == ["E"]
    gemm = model.graph.node[1]
    assert (gemm.op_type, list(gemm.input)) == ("Gemm", ["x", "E"])
    assert helper.get_node_attr_value(gemm, "transB") == 1
    onnx.checker.check_model(model, full_check=True)


def _gate_up_model(k: int, d: int, seed: int = 0):
    """``y = SiluAndMul(MatMul(a, W))`` (``attnexport.SiluAndMul``, with its function body), ``W
    [k, 2d]`` random, and ``W``."""
    from attnexport.lowering.registry import all_bodies

    model, weight = _matmul_model(k, 2 * d, seed)
    graph = model.graph
    graph.node[0].output[0] = "gate_up"
    graph.node.append(helper.make_node("SiluAndMul", ["gate_up"], ["y"], domain=DOMAIN))
    graph.output[0].type.tensor_type.shape.dim[1].dim_value = d
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    (silu,) = [b for b in all_bodies(18) if b.name == "SiluAndMul"]
    model.functions.append(ir.serde.serialize_function(silu))
    return model, weight


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("k, d", [(576, 1536), (37, 64), (100, 96)])
def test_silu_and_mul_fused_into_the_product(k, d, kernels):
    """The SiluAndMul that alone reads a projection joins it (``PackedMatMulSiluAndMul``, its
    panels in gate/up pairs): the float64 result within float32 rounding (the product's bound,
    the activation's ~1e-6 relative), every pass of rows."""
    model, weight = _gate_up_model(k, d)
    assert to_packed_matmul(model) == 1
    assert [n.op_type for n in model.graph.node] == [FUSED_OP_TYPE]
    session = one_model_session(model, kernels)
    a = torch.randn(100, k, generator=torch.Generator().manual_seed(8))
    products = a.double() @ torch.from_numpy(weight).double()
    expected = _silu_and_mul(products)
    # |d silu(g) * u| <= 1.1 |u| |dg| + |silu(g)| |du|; dg, du within the product's bound
    bound = _float32_bound(a, weight)
    gate_bound, up_bound = bound.chunk(2, dim=-1)
    gate, up = products.chunk(2, dim=-1)
    tolerance = 1.1 * up.abs() * gate_bound + torch.nn.functional.silu(gate).abs() * up_bound
    tolerance += 1e-6 * expected.abs() + 1e-30
    for rows in (1, 5, 6, 7, 32, 100):
        y = torch.from_numpy(session.run(None, {"a": a[:rows].numpy()})[0])
        assert y.shape == (rows, d)
        error = (y.double() - expected[:rows]).abs()
        assert (error <= tolerance[:rows]).all(), (rows, (error - tolerance[:rows]).max())


@requires_ort_kernels
def test_the_fused_node_is_the_same_bits_alone_and_in_any_batch():
    model, _ = _gate_up_model(576, 96)
    to_packed_matmul(model)
    session = one_model_session(model, "native")
    a = torch.randn(100, 576, generator=torch.Generator().manual_seed(9)).numpy()
    batch = session.run(None, {"a": a})[0]
    for rows in (slice(0, 1), slice(3, 9), slice(95, 100)):
        assert np.array_equal(session.run(None, {"a": a[rows]})[0], batch[rows])


def test_a_product_read_elsewhere_or_not_in_whole_pairs_is_not_fused():
    model, _ = _gate_up_model(48, 48)  # 96 columns: halves of 48, not whole panels
    assert to_packed_matmul(model) == 1
    assert [n.op_type for n in model.graph.node] == [OP_TYPE, "SiluAndMul"]
    model, _ = _gate_up_model(48, 64)
    model.graph.output.append(helper.make_tensor_value_info("gate_up", TensorProto.FLOAT, None))
    assert to_packed_matmul(model) == 1
    assert [n.op_type for n in model.graph.node] == [OP_TYPE, "SiluAndMul"]


def test_unpacking_splits_the_fused_node_back():
    model, weight = _gate_up_model(48, 64)
    reference = onnx.ModelProto()
    reference.CopyFrom(model)
    to_packed_matmul(model)
    assert to_matmul(model) == 1
    assert [(n.op_type, n.domain) for n in model.graph.node] == [
        ("MatMul", ""),
        ("SiluAndMul", DOMAIN),
    ]
    assert np.array_equal(numpy_helper.to_array(model.graph.initializer[0]), weight)
    assert [f.name for f in model.functions] == ["SiluAndMul"]
    onnx.checker.check_model(model, full_check=True)
    a = torch.randn(3, 48, generator=torch.Generator().manual_seed(10)).numpy()
    np.testing.assert_array_equal(
        one_model_session(model, "bodies").run(None, {"a": a})[0],
        one_model_session(reference, "bodies").run(None, {"a": a})[0],
    )
