"""``attnexport.MatMul8BitsQKVRotary`` / ``MatMul4BitsQKVRotary``: a QKV projection and the
``NeoxQKVRotaryEmbedding`` after it in one node. Its three outputs are the two nodes' bit for bit
(native kernel and function bodies) whatever the call's rows and paths; within the activations'
rounding of the float64 rotation; the lowering fuses only a product that the rotation alone
reads; bad tables get a named error."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from attnexport.lowering.matmul_8bits import (
    OP_TYPES,
    QKV_OP_TYPES,
    fuse_qkv_rotary,
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
from tests.lowering.test_matmul_8bits import BITS, _fed_as_inputs, _matmulnbits_model
from tests.lowering.test_matmul_8bits_silu import KERNEL_PATHS

ROWS = (1, 2, 3, 9, 64, 65, 131)
GEOMETRIES = [(3, 1, 64), (4, 2, 32), (2, 2, 128)]  # (num_heads, num_kv_heads, head_size)


def _tables(rows: int, head_size: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[rows, head_size]`` of positions 0.. (rotate-half layout)."""
    half = head_size // 2
    inverse = 1.0 / 10000 ** (np.arange(half) / half)
    angles = np.arange(rows)[:, None] * inverse[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _qkv_models(k, heads, kv_heads, size, bits, zero_points="float32", int8_from_rows=0):
    """(unfused, fused) models of ``NeoxQKVRotaryEmbedding(MatMul8Bits(a), cos, sin)`` on the
    same random weights, and the float64 ``[N, K]`` weight."""
    (rotary,) = [b for b in all_bodies(18) if b.name == "NeoxQKVRotaryEmbedding"]
    models = []
    for _ in range(2):
        model, weight = _unfused_only(k, heads, kv_heads, size, bits, zero_points, int8_from_rows)
        graph = model.graph
        model.functions.append(ir.serde.serialize_function(rotary))
        graph.input.extend(
            helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", size])
            for name in ("cos", "sin")
        )
        del graph.output[:]
        graph.output.extend(
            helper.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", count, size])
            for name, count in (("query", heads), ("key", kv_heads), ("value", kv_heads))
        )
        models.append(model)
    assert fuse_qkv_rotary(models[1]) == 1
    assert [(node.domain, node.op_type) for node in models[1].graph.node] == [
        (DOMAIN, QKV_OP_TYPES[bits])
    ]
    onnx.checker.check_model(models[1], full_check=True)
    return models[0], models[1], weight


def _rotated(product: torch.Tensor, cos, sin, size: int) -> torch.Tensor:
    """The float64 rotation of every head of ``product`` ``[rows, heads, size]``."""
    half = size // 2
    low, high = product[..., :half], product[..., half:]
    cos, sin = torch.from_numpy(cos).double()[:, None], torch.from_numpy(sin).double()[:, None]
    return torch.cat(
        [
            low * cos[..., :half] - high * sin[..., :half],
            high * cos[..., half:] + low * sin[..., half:],
        ],
        dim=-1,
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("heads, kv_heads, size", GEOMETRIES)
@pytest.mark.parametrize("kernels, int8_from_rows", KERNEL_PATHS)
def test_the_fused_node_gives_the_two_nodes_bits(
    heads, kv_heads, size, kernels, int8_from_rows, bits
):
    k = 200
    unfused, fused, weight = _qkv_models(k, heads, kv_heads, size, bits, "uint8", int8_from_rows)
    two, one = one_model_session(unfused, kernels), one_model_session(fused, kernels)
    a = torch.randn(max(ROWS), k, generator=torch.Generator().manual_seed(11))
    cos, sin = _tables(max(ROWS), size)
    product = a.double() @ torch.from_numpy(weight).T
    rotated_heads = heads + kv_heads
    expected = torch.cat(
        [
            _rotated(
                product[:, : rotated_heads * size].reshape(-1, rotated_heads, size), cos, sin, size
            ),
            product[:, rotated_heads * size :].reshape(-1, kv_heads, size),
        ],
        dim=1,
    )
    scale = 0.02 if int8_from_rows else 2e-4
    for rows in ROWS:
        feed = {"a": a[:rows].numpy(), "cos": cos[:rows], "sin": sin[:rows]}
        outputs = one.run(None, feed)
        for got, want in zip(outputs, two.run(None, feed), strict=True):
            assert np.array_equal(got, want), rows
        got = torch.from_numpy(np.concatenate(outputs, axis=1)).double()
        bound = scale * expected[:rows].abs().amax() + 1e-5
        assert (got - expected[:rows]).abs().max() <= bound, rows


@requires_ort_kernels
@pytest.mark.parametrize("bits", BITS)
def test_weights_the_graph_computes_give_the_same_bits(bits):
    unfused, fused, _ = _qkv_models(577, 3, 1, 64, bits, int8_from_rows=4)
    fed_unfused, values = _fed_as_inputs(unfused, ("q", "scales", "zero_points"))
    fed_fused, _ = _fed_as_inputs(fused, ("q", "scales", "zero_points"))
    a = torch.randn(70, 577, generator=torch.Generator().manual_seed(12)).numpy()
    cos, sin = _tables(70, 64)
    for rows in (1, 4, 70):
        feed = {"a": a[:rows], "cos": cos[:rows], "sin": sin[:rows], **values}
        expected = one_model_session(fed_unfused, "native").run(None, feed)
        for got, want in zip(
            one_model_session(fed_fused, "native").run(None, feed), expected, strict=True
        ):
            assert np.array_equal(got, want)


def test_only_a_product_that_the_rotation_alone_reads_is_fused():
    for case in ("read twice", "graph output", "head size"):
        model, _ = _unfused_only(64, 2, 1, 48 if case == "head size" else 64)
        graph = model.graph
        if case == "read twice":
            graph.node.append(helper.make_node("Relu", ["qkv"], ["other"]))
        if case == "graph output":
            graph.output.append(helper.make_tensor_value_info("qkv", TensorProto.FLOAT, None))
        assert fuse_qkv_rotary(model) == 0, case
        assert graph.node[0].op_type == OP_TYPES[4]
        assert not any(f.name == QKV_OP_TYPES[4] for f in model.functions)


def _unfused_only(k, heads, kv_heads, size, bits=4, zero_points="uint8", int8_from_rows=0):
    """``NeoxQKVRotaryEmbedding(MatMul8Bits(a), cos, sin)``'s two nodes (no rotary body), and the
    float64 ``[N, K]`` weight."""
    n = (heads + 2 * kv_heads) * size
    model, weight = _matmulnbits_model(k, n, 32, zero_points, bits=bits)
    assert to_matmul_8bits(model, True, (bits,), int8_from_rows) == 1
    model.graph.node[0].output[0] = "qkv"
    model.graph.node.append(
        helper.make_node(
            "NeoxQKVRotaryEmbedding",
            ["qkv", "cos", "sin"],
            ["query", "key", "value"],
            domain=DOMAIN,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_size=size,
        )
    )
    return model, weight


@requires_ort_kernels
def test_bad_tables_and_geometry_get_a_named_error():
    _, fused, _ = _qkv_models(64, 3, 1, 64, 4)
    session = one_model_session(fused, "native")
    a = np.ones((5, 64), np.float32)
    cos, sin = _tables(5, 64)
    with pytest.raises(
        Exception, match=r"MatMul4BitsQKVRotary: cos, sin: expected float32 \[5, 64\]"
    ):
        session.run(None, {"a": a, "cos": cos[:4], "sin": sin[:4]})
    (size,) = [a for a in fused.graph.node[0].attribute if a.name == "head_size"]
    size.i = 48
    with pytest.raises(Exception, match=r"MatMul4BitsQKVRotary: expected .* head_size=48"):
        one_model_session(fused, "native")


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    rerun_with(__file__, "avx2_variant", ATTNEXPORT_ISA="avx2")
