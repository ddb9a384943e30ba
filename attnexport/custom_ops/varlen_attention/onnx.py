"""ONNX face of ``varlen_attention``: the ``attnexport.VarlenAttention`` node.

Its body is the shared attention core (:mod:`attnexport.custom_ops.onnx_attention`) over packed
keys addressed by the cumulative key offsets.
"""

from __future__ import annotations

from attnexport.custom_ops import onnx_attention as core
from attnexport.custom_ops.onnx_builder import Builder, refuse_if
from attnexport.custom_ops.onnx_spec import Dim, OnnxOp, Port, attnexport_opset, traced_dims

_KEY_DIMS = ("num_key_tokens", "num_kv_heads", "head_size")
_KEY_DOC = "[num_key_tokens, num_kv_heads, head_size]"


def _geometry(dim: Dim) -> dict[str, int]:
    return core.attention_geometry("key", dim)


def translate(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    scale: float,
    causal: bool = False,
    alibi_slopes=None,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
):
    """attnexport::varlen_attention(...) -> Tensor"""
    return attnexport_opset().VarlenAttention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        core.slopes_or_zeros(query, alibi_slopes),
        **core.mask_values(scale, causal, sliding_window, logits_soft_cap),
        **_geometry(traced_dims(query=query, key=key)),
    )


def body(b: Builder) -> None:
    """``attnexport.VarlenAttention`` in standard ops."""
    dims = core.dims_of(b, paged=False)
    key_starts, _, key_lens = core.offsets(b, "cu_seqlens_k")
    query_offsets = core.offsets(b, "cu_seqlens_q")
    same_count = b.Equal(b.Shape(key_lens), b.Shape(query_offsets[2]))
    key_lens = refuse_if(b, key_lens, [b.Not(same_count)], "cu_seqlens_k_count")

    def rows(key_pos):
        return b.Add(b.Unsqueeze(key_starts, b.ints([1])), b.Unsqueeze(key_pos, b.ints([0])))

    plan = core.plan_of(b, dims, query_offsets, key_lens, rows)
    flags = core.attention_shape_flags(b, dims, "key", "value")
    # [Tk * Hkv, D]: row token * Hkv + kv_head.
    keys = b.Flatten("key", axis=2)
    values = b.Flatten("value", axis=2)
    core.attend(b, "query", keys, values, "alibi_slopes", plan, dims, "output", flags)


ONNX_OPS = (
    OnnxOp(
        node="VarlenAttention",
        doc=(
            "Attention over packed ragged sequences without a cache (encoders, cross-attention at "
            "prefill). Query j of a sequence with q queries and k keys sits at p = k - q + j "
            "(bottom-right); masking as in PagedAttention."
        ),
        summary="Attention over packed ragged sequences without a cache.",
        inputs=(
            Port("query", "T", "[num_query_tokens, num_heads, head_size]", dims=core.QUERY.dims),
            Port("key", "T", _KEY_DOC, dims=_KEY_DIMS),
            Port("value", "T", _KEY_DOC, dims=_KEY_DIMS),
            Port(
                "cu_seqlens_q",
                "I",
                "[num_seqs + 1] int32 cumulative query lengths",
                dims=core.OFFSETS_DIMS,
            ),
            Port(
                "cu_seqlens_k",
                "I",
                "[num_seqs + 1] int32 cumulative key lengths",
                dims=core.OFFSETS_DIMS,
            ),
            core.ALIBI,
        ),
        outputs=(Port("output", "T", "[num_query_tokens, num_heads, head_size]"),),
        type_constraints=core.type_constraints("Query and key"),
        attributes=core.mask_attributes(causal=0),
        torch_op="varlen_attention",
        translate=translate,
        body=body,
        geometry=_geometry,
    ),
)
