"""ONNX face of ``qkv_rotary_embedding``: the ``attnexport.NeoxQKVRotaryEmbedding`` node."""

from __future__ import annotations

from attnexport.custom_ops import onnx_attention as core
from attnexport.custom_ops.onnx_builder import Builder
from attnexport.custom_ops.onnx_spec import Dim, OnnxOp, Port, attnexport_opset, traced_dims
from attnexport.custom_ops.rotary_embedding.onnx import COS, SIN, TYPES, rotary_tables, rotate


def _geometry(dim: Dim) -> dict[str, int]:
    """The head size (the head counts are not in the shapes: they are the op's arguments)."""
    return {"head_size": dim("cos", 1)}


def translate(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """attnexport::qkv_rotary_embedding(Tensor qkv, Tensor cos, Tensor sin, int num_heads,
    int num_kv_heads) -> (Tensor, Tensor, Tensor)"""
    return attnexport_opset().NeoxQKVRotaryEmbedding(
        qkv,
        cos,
        sin,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        **_geometry(traced_dims(cos=cos)),
        _outputs=3,
    )


def body(b: Builder) -> None:
    """``attnexport.NeoxQKVRotaryEmbedding`` in standard ops: a Reshape to heads, one Split,
    the rotation of the query and key heads (in float32) and a copy of the value heads."""
    heads, kv_heads, head_size = core.dims_of(b, paged=False)[:3]
    all_heads = b.Add(heads, b.Add(kv_heads, kv_heads))  # not -1: T may be 0
    shape = b.Concat(b.ints([0]), all_heads, head_size, axis=0)
    sizes = b.Concat(heads, kv_heads, kv_heads, axis=0)
    query, key, value = b.Split(b.Reshape("qkv", shape), sizes, axis=1, outputs=3)
    tables = rotary_tables(b)
    rotate(b, query, tables, "query")
    rotate(b, key, tables, "key")
    b.op("Identity", value, names=["value"])


ONNX_OPS = (
    OnnxOp(
        node="NeoxQKVRotaryEmbedding",
        doc=(
            "The heads of a fused q/k/v projection [num_tokens, (num_heads + 2 * num_kv_heads) "
            "* head_size]: query = its first num_heads heads, key the next num_kv_heads, value "
            "the last num_kv_heads, query and key rotated as by NeoxRotaryEmbedding."
        ),
        summary="Split a fused q/k/v projection into heads; rotate the query and key heads.",
        inputs=(
            Port("qkv", "T", "[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]"),
            COS,
            SIN,
        ),
        outputs=(
            Port("query", "T", "[num_tokens, num_heads, head_size], rotated"),
            Port("key", "T", "[num_tokens, num_kv_heads, head_size], rotated"),
            Port("value", "T", "[num_tokens, num_kv_heads, head_size]"),
        ),
        type_constraints=TYPES,
        attributes=core.GEOMETRY,
        torch_op="qkv_rotary_embedding",
        translate=translate,
        body=body,
        geometry=_geometry,
    ),
)
