"""The native kernels' shape inference (``register.cc``) as onnxruntime sees it at load: an input
dimension onnxruntime knows nothing of stays unknown in the outputs, never the size -1."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from attnexport.lowering.registry import DOMAIN
from tests.helpers import requires_ort_kernels

pytestmark = requires_ort_kernels


def _unnamed_rows_model(op_type: str, width: int) -> bytes:
    """``x [?, width]`` (a dim with neither size nor name) -> ``op_type`` -> ``y``, then
    ``ConstantOfShape(Shape(y))``: onnxruntime folds the ``Shape`` of a fully known shape into a
    constant when the model loads."""
    rows = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])
    nodes = [
        helper.make_node(op_type, ["x"], ["y"], domain=DOMAIN),
        helper.make_node("Shape", ["y"], ["shape"]),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["ones"],
            value=helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]),
        ),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        helper.make_tensor_value_info("ones", TensorProto.FLOAT, None),
    ]
    graph = helper.make_graph(nodes, "unnamed_rows", [rows], outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    )
    model.ir_version = 10
    return model.SerializeToString()


def test_an_unnamed_input_dim_is_not_a_fixed_size_downstream():
    """Regression: the kernels gave such a dim onnxruntime's "-1, no symbol", which onnxruntime
    1.32 records as the fixed size -1; the folded ``Shape`` then made the ``ConstantOfShape``
    fail the load (a tiny PhiMoE export's router). ``SiluAndMul`` stands for every kernel
    whose outputs keep an input's dims (``set_output_shape``)."""
    import onnxruntime as ort

    from attnexport import ort_kernels

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    ort_kernels.register(options)
    session = ort.InferenceSession(_unnamed_rows_model("SiluAndMul", 8), options)
    x = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)
    y, ones = session.run(None, {"x": x})
    assert y.shape == (5, 4)
    np.testing.assert_array_equal(ones, np.ones((5, 4), np.float32))
