"""ONNX face of ``paged_attention``: the ``attnexport.PagedAttention`` node.

Its body is the shared attention core (:mod:`attnexport.custom_ops.onnx_attention`) over keys
gathered from the paged caches through the block table; the plan checks ``seq_lens`` and the
block ids it reads first.
"""

from __future__ import annotations

import onnx
from onnxscript import opset18 as op

from attnexport.custom_ops import onnx_attention as core
from attnexport.custom_ops.onnx_builder import BOOL, INT64, Builder, arange, differs, refuse_if
from attnexport.custom_ops.onnx_spec import (
    CACHE_TYPE_CONSTRAINT,
    CACHES,
    SCALE_TYPE_CONSTRAINT,
    Attribute,
    Dim,
    OnnxOp,
    Port,
    scale_caches,
    traced_dims,
)
from attnexport.custom_ops.onnx_spec import attnexport_opset as attnexport


def _geometry(dim: Dim) -> dict[str, int]:
    return {**core.attention_geometry("key_cache", dim), "block_size": dim("key_cache", 1)}


def translate(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale: float,
    causal: bool = True,
    alibi_slopes=None,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
    key_scale_cache=None,
    value_scale_cache=None,
    sinks=None,
):
    """attnexport::paged_attention(...) -> Tensor"""
    scales = () if key_scale_cache is None else (key_scale_cache, value_scale_cache)
    if sinks is not None:  # the last input: the scale caches' places stay empty without them
        scales = (key_scale_cache, value_scale_cache, op.Cast(sinks, to=onnx.TensorProto.FLOAT))
    return attnexport().PagedAttention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        core.slopes_or_zeros(query, alibi_slopes),
        *scales,
        **core.mask_values(scale, causal, sliding_window, logits_soft_cap),
        **_geometry(traced_dims(query=query, key_cache=key_cache)),
    )


def _checked_seq_lens(b: Builder, dims: core.Dims, table, query_lens):
    """``seq_lens`` in int64 [S], refused (see :func:`refuse_if`) unless one per block-table
    row and query sequence, in [0, table width * block_size], at least the query count when
    causal, and unless the blocks they use hold no negative id (a negative index would wrap in
    ``Gather`` and read another sequence's block; ids past the cache fail the keys' ``Gather``).
    Every allocation of the plan is then bounded by the table's width."""
    seq_lens = b.Cast("seq_lens", to=INT64)
    num_seqs = b.Shape(seq_lens)
    table_shape = b.Shape(table)
    rows, width = (b.Slice(table_shape, b.ints([i]), b.ints([i + 1])) for i in (0, 1))
    causal = b.Cast(b.attribute("causal", "int"), to=BOOL)
    # Every flag is sized by the inputs' shapes, not by their values (a mismatched count that
    # broadcasts is flagged by the shape checks of the same sum).
    seq_lens = refuse_if(
        b,
        seq_lens,
        [
            differs(b, rows, num_seqs),
            differs(b, b.Shape(query_lens), num_seqs),
            b.Less(seq_lens, b.ints([0])),
            b.Greater(seq_lens, b.Mul(width, dims.block_size)),
            b.And(causal, b.Less(seq_lens, query_lens)),
        ],
        "seq_lens",
    )
    used_blocks = b.Div(b.Add(seq_lens, b.Sub(dims.block_size, b.ints([1]))), dims.block_size)
    column = b.Unsqueeze(arange(b, width), b.ints([0]))  # [1, W]
    used = b.Less(column, b.Unsqueeze(used_blocks, b.ints([1])))  # [S, W]
    negative_block = b.And(used, b.Less(table, b.ints([0])))
    return refuse_if(b, seq_lens, [b.Reshape(negative_block, b.ints([-1]))], "block_tables")


def body(b: Builder) -> None:
    """``attnexport.PagedAttention`` over float caches in standard ops (rows widened to
    float32)."""
    _body(b, scaled=False)


def scaled_body(b: Builder) -> None:
    """``attnexport.PagedAttention`` over int8 caches: each gathered row is dequantized as
    ``float(q) * scale`` with its scale from the scale caches."""
    _body(b, scaled=True)


def _body(b: Builder, scaled: bool) -> None:
    dims = core.dims_of(b, paged=True)
    table = b.Cast("block_tables", to=INT64)

    def slots(key_pos):
        # Key k of sequence s: slot table[s, k // block_size] * block_size + k % block_size.
        block = b.Gather(table, b.Div(key_pos, dims.block_size), axis=1)  # [S, L]
        return b.Add(b.Mul(block, dims.block_size), b.Mod(key_pos, dims.block_size))

    query_offsets = core.offsets(b, "query_start_loc")
    seq_lens = _checked_seq_lens(b, dims, table, query_offsets[2])
    plan = core.plan_of(b, dims, query_offsets, seq_lens, slots)
    flags = core.attention_shape_flags(b, dims, "key_cache", "value_cache")
    flags.append(differs(b, b.Shape("key_cache", start=1, end=2), dims.block_size))
    # [num_blocks * block_size * Hkv, D]: row slot * Hkv + kv_head.
    keys = b.Flatten("key_cache", axis=3)
    values = b.Flatten("value_cache", axis=3)
    scales = None
    if scaled:
        for name in ("key_scale_cache", "value_scale_cache"):
            flags.append(differs(b, b.Shape(name), b.Shape("key_cache", end=3)))
        # [num_blocks * block_size * Hkv, 1]: the scale of each row above.
        scales = tuple(b.Flatten(n, axis=3) for n in ("key_scale_cache", "value_scale_cache"))
    sinks = "sinks" if any(v.name == "sinks" for v in b.inputs) else None
    core.attend(
        b, "query", keys, values, "alibi_slopes", plan, dims, "output", flags, scales, sinks
    )


_SEQS = ("num_seqs",)

ONNX_OPS = (
    OnnxOp(
        node="PagedAttention",
        doc=(
            "Attention of packed ragged queries over a paged KV cache: prefill, decode, chunked "
            "prefill, mixed batches and non-causal cross-attention. The q_i queries of sequence "
            "i are its last positions: query j sits at p = seq_lens[i] - q_i + j. Key "
            "k < seq_lens[i] is visible iff (not causal or k <= p) and (sliding_window < 0 or "
            "p - k < sliding_window). A query that sees no key outputs zeros. The caches may "
            "have a dtype of their own (read widened to float32); int8 caches come with their "
            "float32 scale caches [num_blocks, block_size, Hkv] (inputs 7, 8; a row reads as "
            "float(q) * scale). Attention sinks (input 9, after the scale caches or their "
            "empty places) join each row's softmax as a logit per head of a key whose value "
            "is zero."
        ),
        summary="Attention of packed ragged queries over a paged KV cache.",
        inputs=(
            core.QUERY,
            *CACHES,
            Port(
                "block_tables",
                "I",
                "[num_seqs, max_blocks_per_seq] int32",
                dims=(*_SEQS, "max_blocks_per_seq"),
            ),
            Port("seq_lens", "I", "[num_seqs] int32, cached + new tokens per sequence", dims=_SEQS),
            Port(
                "query_start_loc",
                "I",
                "[num_seqs + 1] int32 cumulative query counts",
                dims=core.OFFSETS_DIMS,
            ),
            core.ALIBI,
            *scale_caches(names=False),
            core.SINKS,
        ),
        outputs=(Port("output", "T", "[num_tokens, num_heads, head_size]"),),
        type_constraints=(
            *core.type_constraints("Query and output"),
            CACHE_TYPE_CONSTRAINT,
            SCALE_TYPE_CONSTRAINT,
        ),
        attributes=(
            *core.mask_attributes(causal=1),
            Attribute("block_size", "int", core.GEOMETRY_DOCS["block_size"]),
            Attribute(
                "prefill_bf16",
                "int",
                "1: the native kernel multiplies the queries of sequences with more than one "
                "query token (prefills) in bfloat16 pairs where the CPU has AVX512_BF16 "
                "(queries, keys, values and softmax weights rounded to bfloat16, float32 sums; "
                "the softmax in float32); elsewhere, and in this body, float32. 0: float32.",
                0,
            ),
        ),
        torch_op="paged_attention",
        translate=translate,
        body=body,
        scaled_body=scaled_body,
        geometry=_geometry,
    ),
)
