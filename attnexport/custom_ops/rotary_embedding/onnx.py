"""ONNX face of ``rotary_embedding``: the ``attnexport.NeoxRotaryEmbedding`` node, and the
rotation its body shares with ``NeoxQKVRotaryEmbedding``."""

from __future__ import annotations

from attnexport.custom_ops.onnx_builder import FLOAT, INT64_MAX, Builder, ValueLike
from attnexport.custom_ops.onnx_spec import FLOAT_TYPES, OnnxOp, Port, attnexport_opset

COS = Port("cos", "T", "[num_tokens, head_size] cosines of each token's angles")
SIN = Port("sin", "T", "[num_tokens, head_size] sines of each token's angles")
TYPES = (("T", FLOAT_TYPES, "Input and table dtype."),)


def translate(x, cos, sin):
    """attnexport::rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor"""
    return attnexport_opset().NeoxRotaryEmbedding(x, cos, sin)


def rotary_tables(b: Builder) -> tuple:
    """The node's cos and sin inputs in float32, ``[T, 1, D]`` (broadcast over the heads)."""
    heads_axis = b.ints([1])
    return tuple(b.Unsqueeze(b.Cast(name, to=FLOAT), heads_axis) for name in ("cos", "sin"))


def rotate(b: Builder, x: ValueLike, tables: tuple, output: str) -> None:
    """``output = x * cos + rotate_half(x) * sin`` for x ``[T, heads, D]``, in float32, cast
    back to the dtype of x."""
    cos, sin = tables
    x32 = b.Cast(x, to=FLOAT)
    head_size = b.Shape(x32, start=2)
    # An odd D has no halves to rotate: Gather refuses index D % 2 = 1 of a 1-element tensor,
    # so the node fails instead of rotating misaligned halves (the native kernel refuses too).
    # (A Reshape to an even width would not do: onnxruntime rewrites its shape to -1.)
    odd = b.Gather(b.ints([0]), b.Mod(head_size, b.ints([2])), axis=0)
    half = b.Add(b.Div(head_size, b.ints([2])), odd)
    first = b.Slice(x32, b.ints([0]), half, b.ints([2]))
    second = b.Slice(x32, half, b.ints([INT64_MAX]), b.ints([2]))
    rotated = b.Concat(b.Neg(second), first, axis=2)
    b.op("CastLike", b.Add(b.Mul(x32, cos), b.Mul(rotated, sin)), x, names=[output])


def body(b: Builder) -> None:
    """``attnexport.NeoxRotaryEmbedding`` in standard ops (math in float32, like the other bodies:
    onnxruntime's CPU elementwise kernels have no bfloat16)."""
    rotate(b, "x", rotary_tables(b), "output")


ONNX_OPS = (
    OnnxOp(
        node="NeoxRotaryEmbedding",
        doc=(
            "Rotary position embedding in the rotate-half (GPT-NeoX) layout: output = x * cos + "
            "rotate_half(x) * sin, rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2]), with "
            "the [num_tokens, head_size] tables broadcast over the heads."
        ),
        summary="Rotary position embedding, rotate-half layout.",
        inputs=(Port("x", "T", "[num_tokens, num_heads, head_size], head_size even"), COS, SIN),
        outputs=(Port("output", "T", "[num_tokens, num_heads, head_size]"),),
        type_constraints=TYPES,
        attributes=(),
        torch_op="rotary_embedding",
        translate=translate,
        body=body,
    ),
)
