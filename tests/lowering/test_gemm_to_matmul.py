"""``gemm_to_matmul``: nn.Linear's Gemm becomes MatMul on a constant [in, out] weight (what
onnxruntime's weight quantizer rewrites), with the same numbers."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from attnexport.lowering.onnx_passes import gemm_to_matmul


def _gemm_model(weight: np.ndarray, bias: np.ndarray | None, **attributes) -> onnx.ModelProto:
    inputs = ["x", "W"] + (["b"] if bias is not None else [])
    initializers = [numpy_helper.from_array(weight, "W")]
    if bias is not None:
        initializers.append(numpy_helper.from_array(bias, "b"))
    out = weight.shape[0] if attributes.get("transB") else weight.shape[1]
    graph = helper.make_graph(
        [helper.make_node("Gemm", inputs, ["y"], name="linear", **attributes)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", out])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_becomes_matmul_with_the_same_output(trans_b, with_bias):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((16, 8) if trans_b else (8, 16)).astype(np.float32)
    bias = rng.standard_normal(16).astype(np.float32) if with_bias else None
    x = rng.standard_normal((5, 8)).astype(np.float32)
    proto = _gemm_model(weight, bias, transB=trans_b)
    model = ir.serde.deserialize_model(proto)
    assert gemm_to_matmul(model) == 1
    rewritten = ir.serde.serialize_model(model)
    onnx.checker.check_model(rewritten, full_check=True)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops == (["MatMul", "Add"] if with_bias else ["MatMul"])
    (matmul_weight,) = [
        numpy_helper.to_array(i) for i in rewritten.graph.initializer if i.name.startswith("W")
    ]
    assert matmul_weight.shape == (8, 16)  # [in, out]: the layout MatMulNBits quantizes
    assert [o.name for o in rewritten.graph.output] == ["y"]
    np.testing.assert_allclose(_run(rewritten, x), _run(proto, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "attributes", [{"alpha": 2.0, "transB": 1}, {"beta": 0.5, "transB": 1}, {"transA": 1}]
)
def test_other_gemms_are_left_alone(attributes):
    weight = np.ones((8, 8), np.float32)
    model = ir.serde.deserialize_model(_gemm_model(weight, np.ones(8, np.float32), **attributes))
    assert gemm_to_matmul(model) == 0
    assert [n.op_type for n in model.graph] == ["Gemm"]
