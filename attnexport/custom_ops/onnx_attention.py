"""The attention core the ``PagedAttention`` and ``VarlenAttention`` bodies share: the static
geometry, the checked offsets, the per-step plan and the per-layer attention.

"Plan once, run per layer": the plan (gather indices, mask, output rows) depends only on the
metadata inputs and on the static geometry attributes (``num_heads``, ``num_kv_heads``,
``head_size``, ``block_size``), so after inlining, onnxruntime's common-subexpression
elimination computes it once per step for all layers. Per layer remain: one ``Gather`` each for
queries, keys and values straight into the matmul layouts ([S, Hkv, Q * G, D] and
[S, Hkv, L, D]; no transposes, no other copies of the keys and values), two matmuls, the mask
add, the softmax, and one ``Gather`` of the result rows back to packed tokens. Math in float32.
Memory is O(S * H * max_q * max_seq_len) for the logits, like a padded batch.

The soft cap and ALiBi sit in ``If`` branches: the soft-cap condition is an attribute
(onnxruntime folds it once the function is inlined), the ALiBi one tests the slopes for a
non-zero value (the exporter passes zeros for models without ALiBi). The plan itself has no
``If``: onnxruntime cannot share what it folds out of one across layers.

Also here: what the two nodes' schemas, translations and geometry share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import onnx
import onnx_ir as ir
from onnxscript import opset18 as op

from attnexport.custom_ops.onnx_builder import (
    BOOL,
    FLOAT,
    INT64,
    INT64_MAX,
    Builder,
    ValueLike,
    arange,
    differs,
    refuse_if,
)
from attnexport.custom_ops.onnx_spec import FLOAT_TYPES, TOKENS, Attribute, Dim, Port

# --------------------------------------------------------------------------- the node faces

QUERY = Port(
    "query", "T", "[num_tokens, num_heads, head_size]", dims=(TOKENS, "num_heads", "head_size")
)
OFFSETS_DIMS = ("num_seqs_plus_1",)
ALIBI = Port(
    "alibi_slopes",
    "A",
    "[num_heads] float32 ALiBi slopes: adds slope[h] * (k - p) after the soft cap. The exporter "
    "always supplies it (zeros for a model without ALiBi), because ONNX function bodies cannot "
    "test for an omitted input.",
    optional=True,
)


SINKS = Port(
    "sinks",
    "A",
    "[num_heads] float32 attention sinks: a logit per head in each row's softmax, of a key "
    "whose value is zero (a query that sees no key still gets zeros).",
    optional=True,
    sinks=True,
)


def type_constraints(tensors: str) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """T (``tensors`` dtype), I (int32 indices), A (float32 ALiBi slopes, attention sinks)."""
    return (
        ("T", FLOAT_TYPES, f"{tensors} dtype."),
        ("I", ("tensor(int32)",), "Index type."),
        ("A", ("tensor(float)",), "ALiBi slope and attention sink type."),
    )


GEOMETRY_DOCS = {
    "num_heads": "H: the query's dim 1.",
    "num_kv_heads": "Hkv: the heads dim of the keys (of the caches).",
    "head_size": "D: the query's dim 2.",
    "block_size": "The caches' dim 1 (tokens per block).",
}
# The geometry attributes repeat static input dims (the exporter sets them from the shapes). As
# constants they let onnxruntime compute the bodies' per-step index arithmetic once for all
# layers; read with Shape, it would be computed per layer.
GEOMETRY = tuple(
    Attribute(n, "int", GEOMETRY_DOCS[n]) for n in ("num_heads", "num_kv_heads", "head_size")
)


def mask_attributes(causal: int) -> tuple[Attribute, ...]:
    """The attention attributes: scale, the mask's, then the geometry. (The translated node
    lists them in this order: onnxscript follows the schema.)"""
    return (
        Attribute("scale", "float", "Multiplies q . k."),
        Attribute(
            "causal",
            "int",
            "1: query at position p sees keys k <= p (bottom-right aligned); 0: all keys.",
            causal,
        ),
        Attribute(
            "sliding_window",
            "int",
            "If >= 0, key k is visible only when p - k < sliding_window; -1: no window.",
            -1,
        ),
        Attribute(
            "logits_soft_cap",
            "float",
            "If > 0, logits become cap * tanh(logits / cap) (before ALiBi); 0: off.",
            0.0,
        ),
        *GEOMETRY,
    )


def attention_geometry(keys: str, dim: Dim) -> dict[str, int]:
    """num_heads, num_kv_heads, head_size of an attention node whose keys are input ``keys``."""
    return {
        "num_heads": dim("query", 1),
        "num_kv_heads": dim(keys, -2),
        "head_size": dim("query", 2),
    }


def slopes_or_zeros(query, alibi_slopes):
    """float32 [num_heads] slopes; zeros when the model has no ALiBi (bodies need the input)."""
    if alibi_slopes is None:
        zero = onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [1], [0.0])
        return op.ConstantOfShape(op.Shape(query, start=1, end=2), value=zero)
    return op.Cast(alibi_slopes, to=onnx.TensorProto.FLOAT)


def mask_values(scale, causal, sliding_window, logits_soft_cap) -> dict:
    """The mask attributes of a translated node, from the torch op's arguments."""
    return {
        "scale": float(scale),
        "causal": int(bool(causal)),
        "sliding_window": int(sliding_window),
        "logits_soft_cap": float(logits_soft_cap),
    }


# --------------------------------------------------------------------------- the body core


def attention_shape_flags(
    b: Builder, dims: Dims, keys: ValueLike, values: ValueLike
) -> list[ir.Value]:
    """The per-layer shape checks of an attention node: the query is [T, H, D] and ``keys``
    (``value``s alike) end in [Hkv, D], as the node's attributes say; ``values`` has the
    shape of ``keys`` (the same blocks or tokens). Cheap: Shape and Equal of a few ints."""
    heads_and_size = b.Concat(dims.heads, dims.head_size, axis=0)
    kv_heads_and_size = b.Concat(dims.kv_heads, dims.head_size, axis=0)
    key_shape = b.Shape(keys)
    return [
        differs(b, b.Shape("query", start=1), heads_and_size),
        differs(b, b.Shape(keys, start=-2), kv_heads_and_size),
        differs(b, b.Shape(values), key_shape),
    ]


def offsets(b: Builder, cumulative: ValueLike) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(starts, ends, lengths) int64 [S] of an int32 cumulative-offset tensor [S + 1], which
    must start at 0 and not decrease (in int64: no wrapped difference passes). That the last
    offset is the token count is checked per layer (the token count is a per-layer shape):
    an output of another length fails the final ``Reshape``, a larger offset the ``Gather``."""
    offsets = b.Cast(cumulative, to=INT64)
    starts = b.Slice(offsets, b.ints([0]), b.ints([-1]))
    ends = b.Slice(offsets, b.ints([1]), b.ints([INT64_MAX]))
    first_not_zero = b.Not(b.Equal(b.Slice(offsets, b.ints([0]), b.ints([1])), b.ints([0])))
    offsets = refuse_if(b, offsets, [first_not_zero, b.Less(ends, starts)], cumulative)
    starts = b.Slice(offsets, b.ints([0]), b.ints([-1]))
    ends = b.Slice(offsets, b.ints([1]), b.ints([INT64_MAX]))
    return starts, ends, b.Sub(ends, starts)


def max_or_zero(b: Builder, lengths: ValueLike) -> ir.Value:
    """max(lengths) as a 1-element int64 tensor; 0 for an empty batch."""
    return b.ReduceMax(b.Concat(lengths, b.ints([0]), axis=0), b.ints([0]), keepdims=1)


class Dims(NamedTuple):
    """1-element int64 tensors of the static geometry: H, Hkv, D, G = H / Hkv, block size."""

    heads: ir.Value
    kv_heads: ir.Value
    head_size: ir.Value
    group: ir.Value
    block_size: ir.Value | None


def dims_of(b: Builder, paged: bool) -> Dims:
    """The geometry, from the node's attributes (the exporter sets them from the static shapes).

    Once inlined, equal attributes are equal constants, so onnxruntime's common-subexpression
    elimination computes everything that depends only on them and on the metadata inputs once
    per step instead of once per layer. Dimensions read with ``Shape`` would be new values in
    every layer (onnxruntime neither folds a partly dynamic shape nor merges folded constants).
    """

    def attribute(name: str) -> ir.Value:
        return b.Unsqueeze(b.attribute(name, "int"), b.ints([0]))

    heads, kv_heads = attribute("num_heads"), attribute("num_kv_heads")
    block_size = attribute("block_size") if paged else None
    return Dims(heads, kv_heads, attribute("head_size"), b.Div(heads, kv_heads), block_size)


class Plan(NamedTuple):
    """What an attention call derives from the step's metadata and the static geometry only,
    so that onnxruntime computes it once per step for all layers. Index tensors are int64.

    Rows of a KV head's matrices are (query j, head g of its group): query head
    h = kv_head * G + g uses KV head h // G, as in the reference's repeat_interleave.

    * ``q_index`` [S, Hkv, Q]: rows of the queries viewed as [T * Hkv, G * D] (padding
      queries read row 0).
    * ``kv_index`` [S, Hkv, L]: rows of the keys/values viewed as [N * Hkv, D]. Masked keys
      read the sequence's first key, so slots past a sequence's end (stale or uninitialised
      cache data, maybe NaN) are never read.
    * ``bias`` float32 [S, 1, Q * G, L]: 0 where visible, -inf elsewhere.
    * ``has_key`` bool [S, 1, Q * G, 1]: the query sees at least one key.
    * ``out_index`` [T, Hkv]: rows of the result viewed as [S * Hkv * Q, G * D].
    * ``q_shape``: [S, Hkv, Q * G, D]; ``distance`` float32 [S, 1, Q, 1, L]: k - p (ALiBi).
    """

    q_index: ir.Value
    kv_index: ir.Value
    bias: ir.Value
    has_key: ir.Value
    out_index: ir.Value
    q_shape: ir.Value
    distance: ir.Value


def plan_of(
    b: Builder,
    dims: Dims,
    query_offsets: tuple[ir.Value, ir.Value, ir.Value],
    key_lens: ValueLike,
    key_rows: Callable[[ir.Value], ir.Value],
) -> Plan:
    """The :class:`Plan` of a batch: ``query_offsets`` the checked (starts, ends, lengths)
    int64 [S] of :func:`offsets`, ``key_lens`` int64 [S]; ``key_rows(key_pos)`` maps key
    positions [L] to int64 [S, L] rows of the packed keys or of the cache viewed as
    [NB * BS, Hkv, D] (only valid keys' rows are used)."""
    starts, ends, query_lens = query_offsets
    num_seqs = b.Shape(key_lens)
    max_q = max_or_zero(b, query_lens)
    max_k = max_or_zero(b, key_lens)
    rows_q = b.Mul(max_q, dims.group)
    query_pos = b.Unsqueeze(arange(b, max_q), b.ints([0]))  # [1, Q]
    key_pos = arange(b, max_k)  # [L]
    head = b.Unsqueeze(arange(b, dims.kv_heads), b.ints([0]))  # [1, Hkv]

    def per_head(rows: ValueLike) -> ir.Value:  # [S, X] -> [S, Hkv, X]
        return b.Add(
            b.Unsqueeze(b.Mul(rows, dims.kv_heads), b.ints([1])),
            b.Unsqueeze(head, b.ints([2])),
        )

    query_valid = b.Less(query_pos, b.Unsqueeze(query_lens, b.ints([1])))  # [S, Q]
    query_rows = b.Add(b.Unsqueeze(starts, b.ints([1])), query_pos)
    query_rows = b.Where(query_valid, query_rows, b.ints([0]))

    key_valid = b.Less(key_pos, b.Unsqueeze(key_lens, b.ints([1])))  # [S, L]
    rows = key_rows(key_pos)
    first = b.Slice(rows, b.ints([0]), b.ints([1]), b.ints([1]))  # [S, 1] ([S, 0] if L = 0)
    has_keys = b.Unsqueeze(b.Greater(key_lens, b.ints([0])), b.ints([1]))
    rows = b.Where(key_valid, rows, b.Where(has_keys, first, b.ints([0])))

    # Visibility [S, Q, L]: query j of sequence i sits at p = key_lens[i] - q_i + j.
    p = b.Add(b.Unsqueeze(b.Sub(key_lens, query_lens), b.ints([1])), query_pos)
    p = b.Unsqueeze(p, b.ints([2]))  # [S, Q, 1]
    causal = b.Cast(b.attribute("causal", "int"), to=BOOL)
    window = b.attribute("sliding_window", "int")
    causal_ok = b.Or(b.Not(causal), b.LessOrEqual(key_pos, p))
    window_ok = b.Or(b.Less(window, b.int_scalar(0)), b.Less(b.Sub(p, key_pos), window))
    visible = b.And(b.And(causal_ok, window_ok), b.Unsqueeze(key_valid, b.ints([1])))
    visible5 = b.Unsqueeze(visible, b.ints([1, 3]))  # [S, 1, Q, 1, L]

    def grouped(x: Builder, tensor: ValueLike, heads: ValueLike, last: ValueLike) -> ir.Value:
        """[S, X, Q, 1 or G, Y] -> [S, X, Q * G, Y]."""
        wide = x.Expand(tensor, x.Concat(x.ints([1, 1, 1]), dims.group, x.ints([1]), axis=0))
        shape = x.Concat(num_seqs, heads, rows_q, last, axis=0)
        return x.Reshape(wide, shape, allowzero=1)

    bias = b.Where(visible5, b.float_scalar(0.0), b.float_scalar(float("-inf")))
    bias = grouped(b, bias, b.ints([1]), max_k)
    # k - p [S, 1, Q, 1, L] for ALiBi (per layer: the slopes are a per-layer input).
    distance = b.Unsqueeze(b.Cast(b.Sub(key_pos, p), to=FLOAT), b.ints([1, 3]))

    # A query that sees no key gets zeros (its softmax row is all NaN).
    any_visible = b.ReduceMax(b.Cast(visible, to=FLOAT), b.ints([-1]), keepdims=1)  # [S, Q, 1]
    any_visible = b.Unsqueeze(b.Greater(any_visible, b.float_scalar(0.0)), b.ints([1, 3]))
    has_key = grouped(b, any_visible, b.ints([1]), b.ints([1]))

    # Token t of sequence s, query j: result row (s * Hkv + kv_head) * Q + j.
    token = arange(b, max_or_zero(b, ends))
    # Sequence of token t = number of sequences that end at or before t (empty ones included).
    ended = b.LessOrEqual(b.Unsqueeze(ends, b.ints([0])), b.Unsqueeze(token, b.ints([1])))
    seq_of_token = b.ReduceSum(b.Cast(ended, to=INT64), b.ints([1]), keepdims=0)
    index_in_seq = b.Sub(token, b.Gather(starts, seq_of_token, axis=0))
    out_index = b.Add(
        b.Mul(b.Add(b.Unsqueeze(b.Mul(seq_of_token, dims.kv_heads), b.ints([1])), head), max_q),
        b.Unsqueeze(index_in_seq, b.ints([1])),
    )
    return Plan(
        q_index=per_head(query_rows),
        kv_index=per_head(rows),
        bias=bias,
        has_key=has_key,
        out_index=out_index,
        distance=distance,
        q_shape=b.Concat(num_seqs, dims.kv_heads, rows_q, dims.head_size, axis=0),
    )


def soft_cap(b: Builder, logits: ValueLike) -> ir.Value:
    cap = b.attribute("logits_soft_cap", "float")
    capped = b.branch()
    then_out = capped.Mul(capped.Tanh(capped.Div(logits, cap)), cap)
    plain = b.branch()
    else_out = plain.Identity(logits)
    return b.If(
        b.Greater(cap, b.float_scalar(0.0)),
        then_branch=capped.graph([then_out], "soft_cap"),
        else_branch=plain.graph([else_out], "no_soft_cap"),
    )


def alibi(b: Builder, logits: ValueLike, slopes: ValueLike, plan: Plan, dims: Dims) -> ir.Value:
    """logits [S, Hkv, Q * G, L] + slopes[h] * (k - p), h = kv_head * G + g. The condition
    tests the slopes for a non-zero value (the exporter passes zeros for models without ALiBi):
    with constant slopes onnxruntime folds the ``If``."""
    biased = b.branch()
    slope_shape = biased.Concat(
        biased.ints([1]), dims.kv_heads, biased.ints([1]), dims.group, biased.ints([1]), axis=0
    )
    per_head = biased.Reshape(biased.Cast(slopes, to=FLOAT), slope_shape)  # [1, Hkv, 1, G, 1]
    bias = biased.Mul(per_head, plan.distance)  # [S, Hkv, Q, G, L]
    then_out = biased.Add(logits, biased.Reshape(bias, biased.Shape(logits), allowzero=1))
    plain = b.branch()
    else_out = plain.Identity(logits)
    any_slope = b.Greater(b.ReduceMax(b.Abs(slopes), keepdims=0), b.float_scalar(0.0))
    return b.If(
        any_slope,
        then_branch=biased.graph([then_out], "alibi"),
        else_branch=plain.graph([else_out], "no_alibi"),
    )


def attend(
    b: Builder,
    query: ValueLike,
    keys: ValueLike,
    values: ValueLike,
    slopes: ValueLike,
    plan: Plan,
    dims: Dims,
    output: str,
    shape_flags: list[ir.Value],
    scales: tuple[ValueLike, ValueLike] | None = None,
    sinks: ValueLike | None = None,
) -> ir.Value:
    """The per-layer part: query [T, H, D], keys/values [N * Hkv, D] of any dtype (rows as in
    ``plan``) -> ``output`` [T, H, D] in the query's dtype. Math in float32; the only copies
    of keys and values are the two gathers. ``scales``: float32 [N * Hkv, 1] of int8 keys and
    values (each row reads as ``float(q) * scale``). ``shape_flags`` (1-D bool, true =
    mismatch) refuse the run (:func:`refuse_if`) before the queries are read: they guard the
    2-element width that every read of the queries and of the result goes through, not a big
    tensor."""
    group_width = b.Concat(b.ints([-1]), b.Mul(dims.group, dims.head_size), axis=0)
    group_width = refuse_if(b, group_width, shape_flags, "shapes")
    q = b.Gather(b.Reshape(query, group_width), plan.q_index, axis=0)  # [S, Hkv, Q, G * D]
    q = b.Reshape(b.Cast(q, to=FLOAT), plan.q_shape, allowzero=1)  # [S, Hkv, Q * G, D]
    k = b.Cast(b.Gather(keys, plan.kv_index, axis=0), to=FLOAT)  # [S, Hkv, L, D]
    v = b.Cast(b.Gather(values, plan.kv_index, axis=0), to=FLOAT)
    if scales is not None:  # [S, Hkv, L, 1] scales of the gathered rows
        k = b.Mul(k, b.Gather(scales[0], plan.kv_index, axis=0))
        v = b.Mul(v, b.Gather(scales[1], plan.kv_index, axis=0))
    logits = b.MatMul(q, b.Transpose(k, perm=[0, 1, 3, 2]))  # [S, Hkv, Q * G, L]
    logits = soft_cap(b, b.Mul(logits, b.attribute("scale", "float")))
    logits = alibi(b, logits, slopes, plan, dims)
    logits = b.Add(logits, plan.bias)
    if sinks is None:
        weights = b.Softmax(logits, axis=-1)
    else:  # the sink's column [S, Hkv, Q * G, 1] (row q * G + g: sink[kv_head * G + g])
        # joins the softmax, then is dropped
        head_sinks = b.Concat(b.ints([1]), dims.kv_heads, b.ints([1]), dims.group, axis=0)
        sink = b.Reshape(b.Cast(sinks, to=FLOAT), head_sinks)  # [1, Hkv, 1, G]
        rows = b.Div(b.Shape(logits, start=2, end=3), dims.group)  # Q
        sink = b.Expand(sink, b.Concat(b.Shape(logits, end=2), rows, dims.group, axis=0))
        sink = b.Reshape(sink, b.Concat(b.Shape(logits, end=3), b.ints([1]), axis=0))
        with_sink = b.Softmax(b.Concat(logits, sink, axis=-1), axis=-1)
        weights = b.Slice(with_sink, b.ints([0]), b.Shape(logits, start=3, end=4), b.ints([3]))
    out = b.Where(plan.has_key, b.MatMul(weights, v), b.float_scalar(0.0))  # [S, Hkv, Q*G, D]
    packed = b.Gather(b.Reshape(out, group_width), plan.out_index, axis=0)  # [T', Hkv, G * D]
    # The query's own shape, not [-1, H, D]: T' = the last query offset must be T.
    return b.op("CastLike", b.Reshape(packed, b.Shape(query)), query, names=[output])
