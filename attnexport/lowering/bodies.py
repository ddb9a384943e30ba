"""Standard-ONNX function bodies of the attnexport nodes, so stock onnxruntime runs them.

Every body works for any dynamic shape and follows docs/ops.md exactly (the float64
reference in :mod:`attnexport.custom_ops.reference` is the test oracle):

* ``ReshapeAndCache``: drops padding tokens (negative slots) with ``NonZero`` + ``Gather`` and
  writes the rest with one ``ScatterND`` per cache whose data input is the cache input and whose
  output is the node output. When an inlined graph binds one buffer as both, onnxruntime skips
  the copy and the write costs O(new tokens), not O(cache) (docs/traps.md).
* ``PagedAttention`` / ``VarlenAttention``: "plan once, run per layer". The plan (gather
  indices, mask, output rows) depends only on the metadata inputs and on the static geometry
  attributes (``num_heads``, ``num_kv_heads``, ``head_size``, ``block_size``), so after
  inlining, onnxruntime's common-subexpression elimination computes it once per step for all
  layers. Per layer remain: one ``Gather`` each for queries, keys and values straight into the
  matmul layouts ([S, Hkv, Q * G, D] and [S, Hkv, L, D]; no transposes, no other copies of the
  keys and values), two matmuls, the mask add, the softmax, and one ``Gather`` of the result
  rows back to packed tokens. Math in float32. Memory is O(S * H * max_q * max_seq_len) for
  the logits, like a padded batch.

The soft cap and ALiBi sit in ``If`` branches: the soft-cap condition is an attribute
(onnxruntime folds it once the function is inlined), the ALiBi one tests the slopes for a
non-zero value (the exporter passes zeros for models without ALiBi). The plan itself has no
``If``: onnxruntime cannot share what it folds out of one across layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import onnx

from attnexport.lowering.onnx_builder import BOOL, FLOAT, INT64, Builder, function
from attnexport.lowering.schemas import DOMAIN

_INT64_MAX = 2**63 - 1


def _scalar(b: Builder, one_element: str) -> str:
    """A 0-D tensor from a 1-element 1-D one (Range wants scalars)."""
    return b.Squeeze(one_element, b.ints([0]))


def _arange(b: Builder, length: str) -> str:
    """int64 [0, 1, ..., n - 1] for a 1-element int64 ``length``."""
    return b.Range(b.int_scalar(0), _scalar(b, length), b.int_scalar(1))


def _refuse_if(b: Builder, tensor: str, bad: list[str], what: str) -> str:
    """``tensor`` itself when every element of the 1-D bool tensors ``bad`` is false; else the
    run fails. ONNX has no assert, but onnxruntime refuses a ``Gather`` index past the end: the
    count of bad elements indexes a 1-row copy of ``tensor``, in a node named
    ``invalid_<what>`` that onnxruntime's error quotes. Everything the checks guard reads the
    returned tensor, so onnxruntime cannot compute it (or allocate by it) before they ran."""
    flags = b.Concat(*bad, axis=0) if len(bad) > 1 else bad[0]
    count = b.ReduceSum(b.Cast(flags, to=INT64), keepdims=0)  # 0-D: Gather keeps the shape
    unsqueezed = b.Unsqueeze(tensor, b.ints([0]))
    return b.op("Gather", unsqueezed, count, axis=0, node_hint=f"invalid_{what}")


def _differs(b: Builder, actual: str, expected: str) -> str:
    """1-D bool: true where the 1-D int64 ``actual`` and ``expected`` (shapes, or parts of
    them, of one length) differ."""
    return b.Not(b.Equal(actual, expected))


def _attention_shape_flags(b: Builder, dims: _Dims, keys: str, values: str) -> list[str]:
    """The per-layer shape checks of an attention node: the query is [T, H, D] and ``keys``
    (``value``s alike) end in [Hkv, D], as the node's attributes say; ``values`` has the
    shape of ``keys`` (the same blocks or tokens). Cheap: Shape and Equal of a few ints."""
    heads_and_size = b.Concat(dims.heads, dims.head_size, axis=0)
    kv_heads_and_size = b.Concat(dims.kv_heads, dims.head_size, axis=0)
    key_shape = b.Shape(keys)
    return [
        _differs(b, b.Shape("query", start=1), heads_and_size),
        _differs(b, b.Shape(keys, start=-2), kv_heads_and_size),
        _differs(b, b.Shape(values), key_shape),
    ]


def _offsets(b: Builder, cumulative: str) -> tuple[str, str, str]:
    """(starts, ends, lengths) int64 [S] of an int32 cumulative-offset tensor [S + 1], which
    must start at 0 and not decrease (in int64: no wrapped difference passes). That the last
    offset is the token count is checked per layer (the token count is a per-layer shape):
    an output of another length fails the final ``Reshape``, a larger offset the ``Gather``."""
    offsets = b.Cast(cumulative, to=INT64)
    starts = b.Slice(offsets, b.ints([0]), b.ints([-1]))
    ends = b.Slice(offsets, b.ints([1]), b.ints([_INT64_MAX]))
    first_not_zero = b.Not(b.Equal(b.Slice(offsets, b.ints([0]), b.ints([1])), b.ints([0])))
    offsets = _refuse_if(b, offsets, [first_not_zero, b.Less(ends, starts)], cumulative)
    starts = b.Slice(offsets, b.ints([0]), b.ints([-1]))
    ends = b.Slice(offsets, b.ints([1]), b.ints([_INT64_MAX]))
    return starts, ends, b.Sub(ends, starts)


def _max_or_zero(b: Builder, lengths: str) -> str:
    """max(lengths) as a 1-element int64 tensor; 0 for an empty batch."""
    return b.ReduceMax(b.Concat(lengths, b.ints([0]), axis=0), b.ints([0]), keepdims=1)


class _Dims(NamedTuple):
    """1-element int64 tensors of the static geometry: H, Hkv, D, G = H / Hkv, block size."""

    heads: str
    kv_heads: str
    head_size: str
    group: str
    block_size: str | None


def _dims(b: Builder, paged: bool) -> _Dims:
    """The geometry, from the node's attributes (the exporter sets them from the static shapes).

    Once inlined, equal attributes are equal constants, so onnxruntime's common-subexpression
    elimination computes everything that depends only on them and on the metadata inputs once
    per step instead of once per layer. Dimensions read with ``Shape`` would be new values in
    every layer (onnxruntime neither folds a partly dynamic shape nor merges folded constants).
    """

    def attribute(name: str) -> str:
        return b.Unsqueeze(b.attribute(name, "int"), b.ints([0]))

    heads, kv_heads = attribute("num_heads"), attribute("num_kv_heads")
    block_size = attribute("block_size") if paged else None
    return _Dims(heads, kv_heads, attribute("head_size"), b.Div(heads, kv_heads), block_size)


class _Plan(NamedTuple):
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

    q_index: str
    kv_index: str
    bias: str
    has_key: str
    out_index: str
    q_shape: str
    distance: str


def _plan(
    b: Builder,
    dims: _Dims,
    query_offsets: tuple[str, str, str],
    key_lens: str,
    key_rows: Callable[[str], str],
) -> _Plan:
    """The :class:`_Plan` of a batch: ``query_offsets`` the checked (starts, ends, lengths)
    int64 [S] of :func:`_offsets`, ``key_lens`` int64 [S]; ``key_rows(key_pos)`` maps key
    positions [L] to int64 [S, L] rows of the packed keys or of the cache viewed as
    [NB * BS, Hkv, D] (only valid keys' rows are used)."""
    starts, ends, query_lens = query_offsets
    num_seqs = b.Shape(key_lens)
    max_q = _max_or_zero(b, query_lens)
    max_k = _max_or_zero(b, key_lens)
    rows_q = b.Mul(max_q, dims.group)
    query_pos = b.Unsqueeze(_arange(b, max_q), b.ints([0]))  # [1, Q]
    key_pos = _arange(b, max_k)  # [L]
    head = b.Unsqueeze(_arange(b, dims.kv_heads), b.ints([0]))  # [1, Hkv]

    def per_head(rows: str) -> str:  # [S, X] -> [S, Hkv, X]
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

    def grouped(x: Builder, tensor: str, heads: str, last: str) -> str:
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
    token = _arange(b, _max_or_zero(b, ends))
    # Sequence of token t = number of sequences that end at or before t (empty ones included).
    ended = b.LessOrEqual(b.Unsqueeze(ends, b.ints([0])), b.Unsqueeze(token, b.ints([1])))
    seq_of_token = b.ReduceSum(b.Cast(ended, to=INT64), b.ints([1]), keepdims=0)
    index_in_seq = b.Sub(token, b.Gather(starts, seq_of_token, axis=0))
    out_index = b.Add(
        b.Mul(b.Add(b.Unsqueeze(b.Mul(seq_of_token, dims.kv_heads), b.ints([1])), head), max_q),
        b.Unsqueeze(index_in_seq, b.ints([1])),
    )
    return _Plan(
        q_index=per_head(query_rows),
        kv_index=per_head(rows),
        bias=bias,
        has_key=has_key,
        out_index=out_index,
        distance=distance,
        q_shape=b.Concat(num_seqs, dims.kv_heads, rows_q, dims.head_size, axis=0),
    )


def _soft_cap(b: Builder, logits: str) -> str:
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


def _alibi(b: Builder, logits: str, slopes: str, plan: _Plan, dims: _Dims) -> str:
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


def _attend(
    b: Builder,
    query: str,
    keys: str,
    values: str,
    slopes: str,
    plan: _Plan,
    dims: _Dims,
    output: str,
    shape_flags: list[str],
) -> str:
    """The per-layer part: query [T, H, D], keys/values [N * Hkv, D] (rows as in ``plan``) ->
    ``output`` [T, H, D] in the query's dtype. Math in float32; the only copies of keys and
    values are the two gathers. ``shape_flags`` (1-D bool, true = mismatch) refuse the run
    (:func:`_refuse_if`) before the queries are read: they guard the 2-element width that
    every read of the queries and of the result goes through, not a big tensor."""
    group_width = b.Concat(b.ints([-1]), b.Mul(dims.group, dims.head_size), axis=0)
    group_width = _refuse_if(b, group_width, shape_flags, "shapes")
    q = b.Gather(b.Reshape(query, group_width), plan.q_index, axis=0)  # [S, Hkv, Q, G * D]
    q = b.Reshape(b.Cast(q, to=FLOAT), plan.q_shape, allowzero=1)  # [S, Hkv, Q * G, D]
    k = b.Cast(b.Gather(keys, plan.kv_index, axis=0), to=FLOAT)  # [S, Hkv, L, D]
    v = b.Cast(b.Gather(values, plan.kv_index, axis=0), to=FLOAT)
    logits = b.MatMul(q, b.Transpose(k, perm=[0, 1, 3, 2]))  # [S, Hkv, Q * G, L]
    logits = _soft_cap(b, b.Mul(logits, b.attribute("scale", "float")))
    logits = _alibi(b, logits, slopes, plan, dims)
    weights = b.Softmax(b.Add(logits, plan.bias), axis=-1)
    out = b.Where(plan.has_key, b.MatMul(weights, v), b.float_scalar(0.0))  # [S, Hkv, Q*G, D]
    packed = b.Gather(b.Reshape(out, group_width), plan.out_index, axis=0)  # [T', Hkv, G * D]
    # The query's own shape, not [-1, H, D]: T' = the last query offset must be T.
    return b.op("CastLike", b.Reshape(packed, b.Shape(query)), query, names=[output])


# --------------------------------------------------------------------------- the bodies


def reshape_and_cache(opset: int) -> onnx.FunctionProto:
    """``attnexport.ReshapeAndCache`` in standard ops (NonZero + Gather + ScatterND)."""
    b = Builder()
    block_size = b.Unsqueeze(b.attribute("block_size", "int"), b.ints([0]))
    slots = b.Cast("slot_mapping", to=INT64)
    # Rows with a slot >= 0 (Gather, not Compress: Compress's schema has no bfloat16).
    kept = b.Squeeze(b.NonZero(b.GreaterOrEqual(slots, b.ints([0]))), b.ints([0]))
    slots = b.Gather(slots, kept, axis=0)
    blocks = b.Unsqueeze(b.Div(slots, block_size), b.ints([1]))
    offsets = b.Unsqueeze(b.Mod(slots, block_size), b.ints([1]))
    index = b.Concat(blocks, offsets, axis=1)  # [T', 2] = (block, offset)
    # A slot written twice has no defined value (docs/ops.md; the torch op refuses it): as
    # many distinct slots as kept ones. Shared by every layer like the index.
    distinct = b.op("Unique", slots, outputs=4)[0]
    index = _refuse_if(b, index, [_differs(b, b.Shape(distinct), b.Shape(slots))], "slot_mapping")
    # The index depends on slot_mapping only (shared by every layer after inlining); the
    # shapes are per layer, so the check guards the small index both writes read: no cache
    # is written before a mismatch fails the run.
    key_shape, cache_shape = b.Shape("key"), b.Shape("key_cache")
    index = _refuse_if(
        b,
        index,
        [
            _differs(b, b.Shape("value"), key_shape),
            _differs(b, b.Shape("value_cache"), cache_shape),
            _differs(b, b.Shape("key", start=1), b.Shape("key_cache", start=2)),
            _differs(b, b.Shape("key_cache", start=1, end=2), block_size),
            _differs(b, b.Shape("slot_mapping"), b.Shape("key", end=1)),
        ],
        "shapes",
    )
    for token, cache in (("key", "key_cache"), ("value", "value_cache")):
        b.op("ScatterND", cache, index, b.Gather(token, kept, axis=0), names=[f"{cache}_out"])
    return function(
        b,
        "ReshapeAndCache",
        DOMAIN,
        ["key", "value", "key_cache", "value_cache", "slot_mapping"],
        ["key_cache_out", "value_cache_out"],
        opset,
        {"block_size": None},
        doc="Writes key/value into the paged caches; negative slots are skipped.",
    )


_MASK_ATTRIBUTES = {"scale": None, "sliding_window": -1, "logits_soft_cap": 0.0}
_GEOMETRY_ATTRIBUTES = {"num_heads": None, "num_kv_heads": None, "head_size": None}


def _checked_seq_lens(b: Builder, dims: _Dims, table: str, query_lens: str) -> str:
    """``seq_lens`` in int64 [S], refused (see :func:`_refuse_if`) unless one per block-table
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
    seq_lens = _refuse_if(
        b,
        seq_lens,
        [
            b.Not(b.Equal(rows, num_seqs)),
            b.Not(b.Equal(b.Shape(query_lens), num_seqs)),
            b.Less(seq_lens, b.ints([0])),
            b.Greater(seq_lens, b.Mul(width, dims.block_size)),
            b.And(causal, b.Less(seq_lens, query_lens)),
        ],
        "seq_lens",
    )
    used_blocks = b.Div(b.Add(seq_lens, b.Sub(dims.block_size, b.ints([1]))), dims.block_size)
    column = b.Unsqueeze(_arange(b, width), b.ints([0]))  # [1, W]
    used = b.Less(column, b.Unsqueeze(used_blocks, b.ints([1])))  # [S, W]
    negative_block = b.And(used, b.Less(table, b.ints([0])))
    return _refuse_if(b, seq_lens, [b.Reshape(negative_block, b.ints([-1]))], "block_tables")


def paged_attention(opset: int) -> onnx.FunctionProto:
    """``attnexport.PagedAttention`` in standard ops."""
    b = Builder()
    dims = _dims(b, paged=True)
    table = b.Cast("block_tables", to=INT64)

    def slots(key_pos: str) -> str:
        # Key k of sequence s: slot table[s, k // block_size] * block_size + k % block_size.
        block = b.Gather(table, b.Div(key_pos, dims.block_size), axis=1)  # [S, L]
        return b.Add(b.Mul(block, dims.block_size), b.Mod(key_pos, dims.block_size))

    query_offsets = _offsets(b, "query_start_loc")
    seq_lens = _checked_seq_lens(b, dims, table, query_offsets[2])
    plan = _plan(b, dims, query_offsets, seq_lens, slots)
    flags = _attention_shape_flags(b, dims, "key_cache", "value_cache")
    flags.append(_differs(b, b.Shape("key_cache", start=1, end=2), dims.block_size))
    # [num_blocks * block_size * Hkv, D]: row slot * Hkv + kv_head.
    keys = b.Flatten("key_cache", axis=3)
    values = b.Flatten("value_cache", axis=3)
    _attend(b, "query", keys, values, "alibi_slopes", plan, dims, "output", flags)
    return function(
        b,
        "PagedAttention",
        DOMAIN,
        [
            "query",
            "key_cache",
            "value_cache",
            "block_tables",
            "seq_lens",
            "query_start_loc",
            "alibi_slopes",
        ],
        ["output"],
        opset,
        {**_MASK_ATTRIBUTES, "causal": 1, **_GEOMETRY_ATTRIBUTES, "block_size": None},
        doc="Attention of packed ragged queries over a paged KV cache.",
    )


def varlen_attention(opset: int) -> onnx.FunctionProto:
    """``attnexport.VarlenAttention`` in standard ops."""
    b = Builder()
    dims = _dims(b, paged=False)
    key_starts, _, key_lens = _offsets(b, "cu_seqlens_k")
    query_offsets = _offsets(b, "cu_seqlens_q")
    same_count = b.Equal(b.Shape(key_lens), b.Shape(query_offsets[2]))
    key_lens = _refuse_if(b, key_lens, [b.Not(same_count)], "cu_seqlens_k_count")

    def rows(key_pos: str) -> str:
        return b.Add(b.Unsqueeze(key_starts, b.ints([1])), b.Unsqueeze(key_pos, b.ints([0])))

    plan = _plan(b, dims, query_offsets, key_lens, rows)
    flags = _attention_shape_flags(b, dims, "key", "value")
    # [Tk * Hkv, D]: row token * Hkv + kv_head.
    keys = b.Flatten("key", axis=2)
    values = b.Flatten("value", axis=2)
    _attend(b, "query", keys, values, "alibi_slopes", plan, dims, "output", flags)
    return function(
        b,
        "VarlenAttention",
        DOMAIN,
        ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"],
        ["output"],
        opset,
        {**_MASK_ATTRIBUTES, "causal": 0, **_GEOMETRY_ATTRIBUTES},
        doc="Attention over packed ragged sequences without a cache.",
    )


def _rotary_tables(b: Builder) -> tuple[str, str]:
    """The node's cos and sin inputs in float32, ``[T, 1, D]`` (broadcast over the heads)."""
    heads_axis = b.ints([1])
    return tuple(b.Unsqueeze(b.Cast(name, to=FLOAT), heads_axis) for name in ("cos", "sin"))


def _rotate(b: Builder, x: str, tables: tuple[str, str], output: str) -> None:
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
    second = b.Slice(x32, half, b.ints([_INT64_MAX]), b.ints([2]))
    rotated = b.Concat(b.Neg(second), first, axis=2)
    b.op("CastLike", b.Add(b.Mul(x32, cos), b.Mul(rotated, sin)), x, names=[output])


def rotary_embedding(opset: int) -> onnx.FunctionProto:
    """``attnexport.NeoxRotaryEmbedding`` in standard ops (math in float32, like the other bodies:
    onnxruntime's CPU elementwise kernels have no bfloat16)."""
    b = Builder()
    _rotate(b, "x", _rotary_tables(b), "output")
    return function(
        b,
        "NeoxRotaryEmbedding",
        DOMAIN,
        ["x", "cos", "sin"],
        ["output"],
        opset,
        {},
        doc="Rotary position embedding, rotate-half layout.",
    )


def qkv_rotary_embedding(opset: int) -> onnx.FunctionProto:
    """``attnexport.NeoxQKVRotaryEmbedding`` in standard ops: a Reshape to heads, one Split,
    the rotation of the query and key heads (in float32) and a copy of the value heads."""
    b = Builder()
    heads, kv_heads, head_size = _dims(b, paged=False)[:3]
    all_heads = b.Add(heads, b.Add(kv_heads, kv_heads))  # not -1: T may be 0
    shape = b.Concat(b.ints([0]), all_heads, head_size, axis=0)
    sizes = b.Concat(heads, kv_heads, kv_heads, axis=0)
    query, key, value = b.Split(b.Reshape("qkv", shape), sizes, axis=1, outputs=3)
    tables = _rotary_tables(b)
    _rotate(b, query, tables, "query")
    _rotate(b, key, tables, "key")
    b.op("Identity", value, names=["value"])
    return function(
        b,
        "NeoxQKVRotaryEmbedding",
        DOMAIN,
        ["qkv", "cos", "sin"],
        ["query", "key", "value"],
        opset,
        dict.fromkeys(("num_heads", "num_kv_heads", "head_size")),
        doc="Split a fused q/k/v projection into heads; rotate the query and key heads.",
    )


def silu_and_mul(opset: int) -> onnx.FunctionProto:
    """``attnexport.SiluAndMul`` in standard ops (math in float32)."""
    b = Builder()
    gate, up = b.Split(b.Cast("x", to=FLOAT), axis=-1, num_outputs=2, outputs=2)
    b.op("CastLike", b.Mul(b.Mul(gate, b.Sigmoid(gate)), up), "x", names=["output"])
    return function(
        b, "SiluAndMul", DOMAIN, ["x"], ["output"], opset, {}, doc="silu(x[:, :d]) * x[:, d:]."
    )


def fused_add_rms_norm(opset: int) -> onnx.FunctionProto:
    """``attnexport.FusedAddRMSNorm`` in standard ops: the sum and the product by the weight
    are rounded to the input dtype like the torch op's, computed in float32 (onnxruntime's CPU
    elementwise kernels have no bfloat16)."""
    b = Builder()
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
    return function(
        b,
        "FusedAddRMSNorm",
        DOMAIN,
        ["x", "residual", "weight"],
        ["output", "residual_out"],
        opset,
        {"epsilon": None},
        doc="Residual add, then RMSNorm.",
    )


def all_bodies(opset: int) -> list[onnx.FunctionProto]:
    """The bodies of every attnexport node, for a model of standard opset ``opset`` (>= 18)."""
    if opset < 18:
        raise ValueError(f"opset: expected a standard ONNX opset >= 18, got {opset}")
    return [
        reshape_and_cache(opset),
        paged_attention(opset),
        varlen_attention(opset),
        rotary_embedding(opset),
        qkv_rotary_embedding(opset),
        silu_and_mul(opset),
        fused_add_rms_norm(opset),
    ]
