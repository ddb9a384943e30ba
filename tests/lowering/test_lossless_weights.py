"""``attnexport.LosslessMatMul{4,8}Bits[SiluAndMul]`` (float32 weights stored as their exact
low-bit codes): the code reproduces GGUF-de-quantized weights bit for bit (gguf's own quantizer
makes them) and is refused for weights without the form; the native kernel's outputs are
``PackedMatMul``'s bit for bit on every path (one pass, the decoded scratch of longer calls,
the fused SiluAndMul, both kernel variants); the function body is the float64 product within
float32 rounding; bad codes get a named error; the rewrite and its inverse."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from onnx import numpy_helper

from attnexport.lowering.lossless_weights import (
    FUSED_OP_TYPES,
    OP_TYPES,
    code_packed_weights,
    code_weight,
    decode_weight,
    to_float_matmul,
    to_packed_matmul,
)
from attnexport.lowering.packed_matmul import FUSED_OP_TYPE, OP_TYPE
from tests.helpers import (
    ORT_KERNEL_MODES,
    one_model_session,
    requires_avx512_kernels,
    requires_ort_kernels,
    rerun_with,
)
from tests.lowering.test_packed_matmul import (
    _float32_bound,
    _gate_up_model,
    _matmul_model,
    _tied_model,
)
from tests.lowering.test_packed_matmul import to_packed_matmul as to_float_panels

GGUF_BITS = {"Q4_1": 4, "Q8_0": 8, "Q4_0": 8}
"""The code each GGUF block format's weights get: Q4_0's (codes -8..7, d of either sign) are
8-bit codes with m = -0.0, so that a negative-scale block's -0.0 comes back."""


def gguf_weight(k: int, n: int, kind: str, seed: int = 0) -> np.ndarray:
    """A ``[k, n]`` float32 weight as transformers loads a GGUF tensor of ``kind``: random
    weights quantized and de-quantized by the ``gguf`` package, its blocks of 32 along ``k``."""
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).numpy()
    kind = GGMLQuantizationType[kind]
    return np.ascontiguousarray(dequantize(quantize(x, kind), kind).T)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("kind", GGUF_BITS)
@pytest.mark.parametrize("k, n", [(576, 96), (64, 32)])
def test_gguf_weights_are_coded_and_decoded_bit_for_bit(kind, k, n):
    weight = gguf_weight(k, n, kind)
    if kind == "Q4_0":  # the case the 8-bit code's m = -0.0 is for
        assert np.signbit(weight[weight == 0]).any()
    coded = code_weight(weight)
    assert coded is not None and coded.bits == GGUF_BITS[kind]
    assert coded.shape == (k, n)
    assert _same_bits(decode_weight(coded), weight)
    assert coded.codes.nbytes + coded.params.nbytes <= weight.nbytes * (1.125 / 4)


@pytest.mark.parametrize(
    "weight",
    [
        pytest.param(np.random.default_rng(0).standard_normal((64, 32)), id="trained float32"),
        pytest.param(
            np.random.default_rng(1).standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
            id="bfloat16 numbers",
        ),
        pytest.param(gguf_weight(64, 32, "Q4_1")[:40], id="K not whole blocks"),
        pytest.param(gguf_weight(64, 48, "Q4_1")[:, :40], id="N not whole panels"),
        pytest.param(np.full((64, 32), np.inf), id="not finite"),
    ],
)
def test_weights_without_the_form_are_not_coded(weight):
    assert code_weight(np.ascontiguousarray(weight, dtype=np.float32)) is None


def test_blocks_of_one_number_are_coded():
    weight = gguf_weight(64, 32, "Q4_1")
    weight[:32, 3] = 0.25
    weight[32:, 5] = 0.0
    weight[:32, 7] = -0.0  # (a negative d gives it back: fma(0, d, -0.0) is -0.0)
    coded = code_weight(weight)
    assert coded is not None and _same_bits(decode_weight(coded), weight)


@pytest.mark.parametrize("chunk_blocks", [1 << 18, 5])
def test_one_block_off_the_form_leaves_the_weight_float32(chunk_blocks, monkeypatch):
    """(In chunks of 5 blocks too: the search solves large weights a chunk at a time.)"""
    from attnexport.lowering import lossless_weights

    monkeypatch.setattr(lossless_weights, "_CHUNK_BLOCKS", chunk_blocks)
    weight = gguf_weight(576, 64, "Q4_1")
    coded = code_weight(weight)
    assert coded is not None and _same_bits(decode_weight(coded), weight)
    weight[300, 17] = np.nextafter(weight[300, 17], np.float32(np.inf))
    assert code_weight(weight) is None


def _coded_model(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = ir.from_proto(model)
    assert code_packed_weights(graph) == 1
    return ir.to_proto(graph)


def _panels_and_codes(k: int, n: int, kind: str, fused: bool = False):
    """The float panels' model and the coded one of ``y = a @ W`` (``fused``: of
    ``SiluAndMul(a @ W)``, ``n`` then the gate/up width), and ``W``."""
    if fused:
        model, _ = _gate_up_model(k, n // 2)
    else:
        model, _ = _matmul_model(k, n)
    weight = gguf_weight(k, n, kind)
    for init in model.graph.initializer:
        if init.name == model.graph.node[0].input[1]:
            init.CopyFrom(numpy_helper.from_array(weight, init.name))
    assert to_float_panels(model) == 1
    return model, _coded_model(model), weight


ROWS = (1, 2, 3, 5, 6, 7, 8, 13, 32, 96, 97, 200)
"""One pass of rows (1-6; AVX2 1-2), the decoded scratch of longer calls, a row block's end."""


@requires_ort_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 64), (64, 160)])
def test_the_native_outputs_are_the_float_panels_bit_for_bit(k, n, kind):
    panels, coded, _ = _panels_and_codes(k, n, kind)
    assert coded.graph.node[0].op_type == OP_TYPES[GGUF_BITS[kind]]
    plain, lossless = one_model_session(panels, "native"), one_model_session(coded, "native")
    a = torch.randn(200, k, generator=torch.Generator().manual_seed(1)).numpy()
    for rows in ROWS:
        expected = plain.run(None, {"a": a[:rows]})[0]
        assert _same_bits(lossless.run(None, {"a": a[:rows]})[0], expected), rows


@requires_ort_kernels
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_fused_silu_and_mul_is_the_float_panels_bit_for_bit(kind):
    panels, coded, _ = _panels_and_codes(576, 256, kind, fused=True)
    assert panels.graph.node[0].op_type == FUSED_OP_TYPE
    assert coded.graph.node[0].op_type == FUSED_OP_TYPES[GGUF_BITS[kind]]
    plain, lossless = one_model_session(panels, "native"), one_model_session(coded, "native")
    a = torch.randn(200, 576, generator=torch.Generator().manual_seed(2)).numpy()
    for rows in ROWS:
        expected = plain.run(None, {"a": a[:rows]})[0]
        assert _same_bits(lossless.run(None, {"a": a[:rows]})[0], expected), rows


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_the_product_is_the_float64_product_within_float32_rounding(kind, kernels):
    """The function body (stock onnxruntime) decodes the same weights; both paths against the
    float64 product of the checkpoint's weights."""
    _, coded, weight = _panels_and_codes(96, 64, kind)
    session = one_model_session(coded, kernels)
    a = torch.randn(40, 96, generator=torch.Generator().manual_seed(3))
    y = torch.from_numpy(session.run(None, {"a": a.numpy()})[0]).double()
    error = (y - a.double() @ torch.from_numpy(weight).double()).abs()
    assert (error <= _float32_bound(a, weight)).all()


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_the_fused_node_is_the_float_panels_fused_node_bit_for_bit_on_both_paths(kernels):
    """(The function body decodes the same weights, then runs PackedMatMulSiluAndMul's.)"""
    panels, coded, _ = _panels_and_codes(64, 128, "Q4_1", fused=True)
    a = torch.randn(9, 64, generator=torch.Generator().manual_seed(4)).numpy()
    expected = one_model_session(panels, kernels).run(None, {"a": a})[0]
    assert _same_bits(one_model_session(coded, kernels).run(None, {"a": a})[0], expected)


@requires_avx512_kernels
def test_the_avx2_variant_passes_these_tests_too():
    rerun_with(__file__, "bit_for_bit", ATTNEXPORT_ISA="avx2")


@requires_ort_kernels
@pytest.mark.parametrize(
    "bad, message",
    [
        ("codes_type", r"LosslessMatMul4Bits: codes: expected uint8 \[3, 64, 16\], got int8"),
        ("params_shape", r"LosslessMatMul4Bits: params: expected float16 \[3, 2, 2, 32\], got"),
    ],
)
def test_codes_that_do_not_fit_the_attributes_get_a_named_error(bad, message):
    _, coded, _ = _panels_and_codes(64, 96, "Q4_1")
    inits = {i.name: i for i in coded.graph.initializer}
    codes, params = (inits[name] for name in coded.graph.node[0].input[1:])
    if bad == "codes_type":
        array = numpy_helper.to_array(codes).view(np.int8)
        codes.CopyFrom(numpy_helper.from_array(array, codes.name))
    else:
        array = numpy_helper.to_array(params)[:, :1]
        params.CopyFrom(numpy_helper.from_array(array, params.name))
    del coded.graph.value_info[:]
    with pytest.raises(Exception, match=message):
        one_model_session(coded, "native").run(None, {"a": np.ones((1, 64), np.float32)})


@requires_ort_kernels
def test_k_not_whole_blocks_gets_a_named_error_at_load():
    _, coded, _ = _panels_and_codes(64, 96, "Q4_1")
    for attribute in coded.graph.node[0].attribute:
        if attribute.name == "K":
            attribute.i = 48
    expected = r"LosslessMatMul4Bits: expected K > 0 a multiple of 32 and N a positive multiple"
    with pytest.raises(Exception, match=expected):
        one_model_session(coded, "native")


def test_the_rewrite_codes_only_weights_with_the_form():
    model, _ = _matmul_model(64, 96)  # random float32 weights
    assert to_float_panels(model) == 1
    graph = ir.from_proto(model)
    assert code_packed_weights(graph) == 0
    assert [n.op_type for n in graph.graph] == [OP_TYPE]


def test_decoding_gives_back_the_float_panels_and_then_the_matmul():
    for fused in (False, True):
        panels, coded, _ = _panels_and_codes(64, 128, "Q4_1", fused=fused)
        decoded = onnx.ModelProto()
        decoded.CopyFrom(coded)
        assert to_packed_matmul(decoded) == 1
        assert [n.op_type for n in decoded.graph.node] == [n.op_type for n in panels.graph.node]
        initializers = {i.name: numpy_helper.to_array(i) for i in decoded.graph.initializer}
        for init in panels.graph.initializer:
            assert _same_bits(initializers[init.name], numpy_helper.to_array(init))
        assert not any(
            f.name in (*OP_TYPES.values(), *FUSED_OP_TYPES.values()) for f in decoded.functions
        )
    # the quantizer's entry: a coded model straight back to MatMul on the [K, N] weight
    _, coded, weight = _panels_and_codes(64, 96, "Q8_0")
    assert to_float_matmul(coded) == 1
    (node,) = coded.graph.node
    assert node.op_type == "MatMul"
    (init,) = [i for i in coded.graph.initializer if i.name == node.input[1]]
    assert _same_bits(numpy_helper.to_array(init), weight)


def test_a_tied_logits_projection_is_coded_beside_its_table():
    """The table stays float32 for the Gather; the logits projection reads its codes."""
    model, _ = _tied_model(vocab=96, hidden=64)
    table = np.ascontiguousarray(gguf_weight(64, 96, "Q8_0").T)  # blocks along hidden
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(table, "E"))
    assert to_float_panels(model) == 1
    coded = _coded_model(model)
    names = sorted(i.name for i in coded.graph.initializer)
    assert names == ["E", "E.panels.codes", "E.panels.params"]
    ids = np.array([0, 5, 95], np.int64)
    logits = one_model_session(coded, "bodies").run(None, {"ids": ids})[0]
    expected = table[ids].astype(np.float64) @ table.T.astype(np.float64)
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-4)
    assert to_float_matmul(coded) == 1
    assert [i.name for i in coded.graph.initializer] == ["E"]
    assert [n.op_type for n in coded.graph.node] == ["Gather", "Gemm"]
