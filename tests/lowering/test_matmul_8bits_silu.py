"""``attnexport.MatMul8BitsSiluAndMul`` / ``MatMul4BitsSiluAndMul``: a gate/up projection and the
``SiluAndMul`` after it in one node. Its numbers are the two nodes' bit for bit (native kernel
and function bodies), whatever the call's rows, paths (int16, int8 steps, weights the graph
computes, the AVX2 variant) and item boundaries; within the activations' rounding of the
float64 ``silu(gate) * up``; the lowering fuses only a product that ``SiluAndMul`` alone reads."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from attnexport.lowering.matmul_8bits import (
    FUSED_OP_TYPES,
    OP_TYPES,
    fuse_silu_and_mul,
    to_matmul_8bits,
)
from attnexport.lowering.registry import all_bodies
from attnexport.model_contract import DOMAIN
from tests.helpers import (
    one_model_session,
    requires_avx512_kernels,
    requires_ort_kernels,
    rerun_with,
)
from tests.lowering.test_matmul_8bits import (
    BITS,
    ZERO_POINTS,
    _fed_as_inputs,
    _matmulnbits_model,
    _rounding_bound,
)

KERNEL_PATHS = [  # (int8 steps are the native kernel's; the bodies compute float32)
    ("bodies", 0),
    pytest.param("native", 0, marks=requires_ort_kernels),
    pytest.param("native", 9, marks=requires_ort_kernels),
]
ROWS = (1, 2, 3, 8, 9, 64, 65, 131)  # passes of 8/4/2/1 rows, items of 64 rows, int8 from 9


def _gate_up_models(k, n, block, zero_points, bits, int8_from_rows=0, batch_invariant=True):
    """(unfused, fused) models of ``SiluAndMul(MatMul8Bits(a))`` on the same random weights, and
    the float64 ``[n, k]`` weight."""
    (silu,) = [b for b in all_bodies(18) if b.name == "SiluAndMul"]
    models = []
    for _ in range(2):
        model, weight = _matmulnbits_model(k, n, block, zero_points, bits=bits)
        assert to_matmul_8bits(model, batch_invariant, (bits,), int8_from_rows) == 1
        model.graph.node[0].output[0] = "gate_up"
        model.graph.node.append(helper.make_node("SiluAndMul", ["gate_up"], ["y"], domain=DOMAIN))
        model.functions.append(ir.serde.serialize_function(silu))
        model.graph.output[0].CopyFrom(
            helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n // 2])
        )
        models.append(model)
    assert fuse_silu_and_mul(models[1]) == 1
    assert [(node.domain, node.op_type) for node in models[1].graph.node] == [
        (DOMAIN, FUSED_OP_TYPES[bits])
    ]
    onnx.checker.check_model(models[1], full_check=True)
    return models[0], models[1], weight


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("zero_points", ZERO_POINTS)
@pytest.mark.parametrize("kernels, int8_from_rows", KERNEL_PATHS)
@pytest.mark.parametrize("k, n, block", [(576, 96, 32), (577, 64, 32), (1536, 96, 64)])
def test_the_fused_node_gives_the_two_nodes_bits(
    k, n, block, zero_points, kernels, bits, int8_from_rows
):
    unfused, fused, weight = _gate_up_models(k, n, block, zero_points, bits, int8_from_rows)
    two, one = one_model_session(unfused, kernels), one_model_session(fused, kernels)
    a = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(3))
    product = a.double() @ torch.from_numpy(weight).T
    gate, up = product[:, : n // 2], product[:, n // 2 :]
    expected = torch.nn.functional.silu(gate) * up
    levels = 127 if int8_from_rows else 32767
    bound = _rounding_bound(a, weight, block, levels)
    # |d(silu(g) u)| <= |silu'(g)| |dg| |u| + |silu(g)| |du| + |dg| |du|, |silu'| < 1.1
    dg, du = bound[:, : n // 2], bound[:, n // 2 :]
    allowed = 1.1 * dg * up.abs() + torch.nn.functional.silu(gate).abs() * du + dg * du
    allowed += 1e-6 * expected.abs() + 1e-30
    for rows in ROWS:
        feed = {"a": a[:rows].numpy()}
        y = one.run(None, feed)[0]
        assert y.shape == (rows, n // 2)
        assert np.array_equal(y, two.run(None, feed)[0]), rows
        error = (torch.from_numpy(y).double() - expected[:rows]).abs()
        assert (error <= allowed[:rows]).all(), (rows, (error - allowed[:rows]).max())


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
def test_weights_the_graph_computes_give_the_same_bits(bits):
    """The paths without the kernel's copies (weights and parameters fed as inputs)."""
    unfused, fused, _ = _gate_up_models(577, 64, 32, "float32", bits, int8_from_rows=4)
    fed_unfused, values = _fed_as_inputs(unfused, ("q", "scales", "zero_points"))
    fed_fused, _ = _fed_as_inputs(fused, ("q", "scales", "zero_points"))
    a = torch.randn(70, 577, generator=torch.Generator().manual_seed(4)).numpy()
    for rows in (1, 3, 4, 70):
        feed = {"a": a[:rows], **values}
        expected = one_model_session(fed_unfused, "native").run(None, feed)[0]
        assert np.array_equal(one_model_session(fed_fused, "native").run(None, feed)[0], expected)


@requires_ort_kernels
def test_without_batch_invariance_the_float32_panels_give_the_same_bits():
    """8-bit blocks over 256 without batch invariance take the float32 panels (6 columns an
    item): fused, each item's gate and up columns the same products."""
    unfused, fused, _ = _gate_up_models(1024, 64, 512, "uint8", 8, batch_invariant=False)
    a = torch.randn(70, 1024, generator=torch.Generator().manual_seed(5)).numpy()
    for rows in (1, 4, 70):
        feed = {"a": a[:rows]}
        expected = one_model_session(unfused, "native").run(None, feed)[0]
        assert np.array_equal(one_model_session(fused, "native").run(None, feed)[0], expected)


def test_only_a_product_that_silu_and_mul_alone_reads_is_fused():
    for case in ("read twice", "graph output", "columns"):
        n = 48 if case == "columns" else 64
        model, _ = _matmulnbits_model(64, n, 32, "uint8", bits=4)
        assert to_matmul_8bits(model, bits=(4,)) == 1
        model.graph.node[0].output[0] = "gate_up"
        model.graph.node.append(helper.make_node("SiluAndMul", ["gate_up"], ["y"], domain=DOMAIN))
        if case == "read twice":
            model.graph.node.append(helper.make_node("Relu", ["gate_up"], ["other"]))
        if case == "graph output":
            model.graph.output.append(
                helper.make_tensor_value_info("gate_up", TensorProto.FLOAT, None)
            )
        assert fuse_silu_and_mul(model) == 0, case
        assert model.graph.node[0].op_type == OP_TYPES[4]
        assert not any(f.name == FUSED_OP_TYPES[4] for f in model.functions)


@requires_ort_kernels
def test_a_fused_node_whose_halves_are_not_whole_tiles_gets_a_named_error():
    _, fused, _ = _gate_up_models(64, 64, 32, "uint8", 4)
    node = fused.graph.node[0]
    (n,) = [a for a in node.attribute if a.name == "N"]
    n.i = 48
    with pytest.raises(
        Exception, match=r"MatMul4BitsSiluAndMul: expected N .* multiple of 32, got N=48"
    ):
        one_model_session(fused, "native")


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    rerun_with(__file__, "avx2_variant", ATTNEXPORT_ISA="avx2")


def test_the_fused_body_brings_the_functions_it_calls():
    """The fused node's body calls MatMul4Bits' and SiluAndMul's functions: a model without
    SiluAndMul's gets it from the fusion, and stock onnxruntime (the bodies) runs the node."""
    _, fused, _ = _gate_up_models(64, 64, 32, "uint8", 4)
    model, _ = _matmulnbits_model(64, 64, 32, "uint8", bits=4)
    assert to_matmul_8bits(model, bits=(4,)) == 1
    model.graph.node[0].output[0] = "gate_up"
    model.graph.node.append(helper.make_node("SiluAndMul", ["gate_up"], ["y"], domain=DOMAIN))
    model.graph.output[0].CopyFrom(
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 32])
    )
    assert not any(f.name == "SiluAndMul" for f in model.functions)
    assert fuse_silu_and_mul(model) == 1
    assert {f.name for f in model.functions} >= {"MatMul4Bits", "SiluAndMul", FUSED_OP_TYPES[4]}
    a = np.ones((3, 64), np.float32)
    expected = one_model_session(fused, "bodies").run(None, {"a": a})[0]
    assert np.array_equal(one_model_session(model, "bodies").run(None, {"a": a})[0], expected)
