"""ONNX face of ``fused_add_rms_norm``: the ``attnexport.FusedAddRMSNorm`` node."""

from __future__ import annotations

from attnexport.custom_ops.onnx_builder import FLOAT, Builder
from attnexport.custom_ops.onnx_spec import (
    FLOAT_TYPES,
    Attribute,
    OnnxOp,
    Port,
    attnexport_opset,
)


def translate(x, residual, weight, epsilon: float):
    """attnexport::fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float epsilon)
    -> (Tensor, Tensor)"""
    return attnexport_opset().FusedAddRMSNorm(
        x, residual, weight, epsilon=float(epsilon), _outputs=2
    )


def body(b: Builder) -> None:
    """``attnexport.FusedAddRMSNorm`` in standard ops: the sum and the product by the weight
    are rounded to the input dtype like the torch op's, computed in float32 (onnxruntime's CPU
    elementwise kernels have no bfloat16)."""
    total = b.op(
        "CastLike",
        b.Add(b.Cast("x", to=FLOAT), b.Cast("residual", to=FLOAT)),
        "x",
        names=["residual_out"],
    )
    t = b.Cast(total, to=FLOAT)
    mean_square = b.ReduceMean(b.Mul(t, t), b.ints([-1]), keepdims=1)
    normed = b.CastLike(b.Div(t, b.Sqrt(b.Add(mean_square, b.attribute("epsilon", "float")))), "x")
    scaled = b.Mul(b.Cast("weight", to=FLOAT), b.Cast(normed, to=FLOAT))
    b.op("CastLike", scaled, "x", names=["output"])


ONNX_OPS = (
    OnnxOp(
        node="FusedAddRMSNorm",
        doc=(
            "A residual add and Llama's RMSNorm: residual_out = x + residual (in T); output = "
            "weight * T(t / sqrt(mean(t^2 over the last axis) + epsilon)), t = residual_out in "
            "float32."
        ),
        summary="Residual add, then RMSNorm.",
        inputs=(
            Port("x", "T", "[..., num_tokens, hidden] the block's output"),
            Port("residual", "T", "[..., num_tokens, hidden] the residual stream"),
            Port("weight", "T", "[hidden] the norm's scale"),
        ),
        outputs=(
            Port("output", "T", "[..., num_tokens, hidden] the normalized sum"),
            Port("residual_out", "T", "[..., num_tokens, hidden] x + residual"),
        ),
        type_constraints=(("T", FLOAT_TYPES, "Input and output dtype."),),
        attributes=(Attribute("epsilon", "float", "Added to the mean square."),),
        torch_op="fused_add_rms_norm",
        translate=translate,
        body=body,
    ),
)
