"""ONNX face of ``silu_and_mul``: the ``attnexport.SiluAndMul`` node."""

from __future__ import annotations

from attnexport.custom_ops.onnx_builder import FLOAT, Builder
from attnexport.custom_ops.onnx_spec import FLOAT_TYPES, OnnxOp, Port, attnexport_opset


def translate(x):
    """attnexport::silu_and_mul(Tensor x) -> Tensor"""
    return attnexport_opset().SiluAndMul(x)


def body(b: Builder) -> None:
    """``attnexport.SiluAndMul`` in standard ops (math in float32)."""
    gate, up = b.Split(b.Cast("x", to=FLOAT), axis=-1, num_outputs=2, outputs=2)
    b.op("CastLike", b.Mul(b.Mul(gate, b.Sigmoid(gate)), up), "x", names=["output"])


ONNX_OPS = (
    OnnxOp(
        node="SiluAndMul",
        doc=(
            "SwiGLU's gate of a fused gate/up projection: output = silu(x[..., :d]) * "
            "x[..., d:] with silu(g) = g * sigmoid(g)."
        ),
        summary="silu(x[..., :d]) * x[..., d:].",
        inputs=(Port("x", "T", "[..., num_tokens, 2 * d]: the gate half, then the up half"),),
        outputs=(Port("output", "T", "[..., num_tokens, d]"),),
        type_constraints=(("T", FLOAT_TYPES, "Input and output dtype."),),
        attributes=(),
        torch_op="silu_and_mul",
        translate=translate,
        body=body,
    ),
)
