"""Standard-ONNX function bodies of the attnexport nodes, so stock onnxruntime runs them.

Every body works for any dynamic shape and follows DESIGN.md section 3 exactly (the float64
reference in :mod:`attnexport.custom_ops.reference` is the test oracle):

* ``ReshapeAndCache``: drops padding tokens (negative slots) with ``NonZero`` + ``Gather`` and
  writes the rest with one ``ScatterND`` per cache whose data input is the cache input and whose
  output is the node output. When an inlined graph binds one buffer as both, onnxruntime skips
  the copy and the write costs O(new tokens), not O(cache) (DESIGN.md section 4).
* ``PagedAttention`` / ``VarlenAttention``: queries are padded per sequence to
  ``[S, max_q, H, D]`` and keys gathered to ``[S, L, Hkv, D]`` (through the block table, or
  from the packed keys); grouped-query matmuls, the soft cap, ALiBi, the causal/window mask,
  softmax and the value matmul run in float32; the result is gathered back to packed tokens.
  Memory is O(S * max_q * H * L) for the logits, like a padded batch.

The soft cap and ALiBi sit in ``If`` branches: the soft-cap condition is an attribute
(onnxruntime folds it once the function is inlined), the ALiBi one tests the slopes for a
non-zero value (the exporter passes zeros for models without ALiBi).
"""

from __future__ import annotations

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


def _offsets(b: Builder, cumulative: str) -> tuple[str, str, str]:
    """(starts, ends, lengths) int64 [S] of an int32 cumulative-offset tensor [S + 1]."""
    offsets = b.Cast(cumulative, to=INT64)
    starts = b.Slice(offsets, b.ints([0]), b.ints([-1]))
    ends = b.Slice(offsets, b.ints([1]), b.ints([_INT64_MAX]))
    return starts, ends, b.Sub(ends, starts)


def _max_or_zero(b: Builder, lengths: str) -> str:
    """max(lengths) as a 1-element int64 tensor; 0 for an empty batch."""
    return b.ReduceMax(b.Concat(lengths, b.ints([0]), axis=0), b.ints([0]), keepdims=1)


def _pad_rows(b: Builder, packed: str, starts: str, lengths: str, width: str) -> tuple[str, str]:
    """Gathers the rows of each sequence from a packed [N, ...] tensor into [S, width, ...];
    returns it and the validity mask [S, width] (padding rows repeat row 0)."""
    column = _arange(b, width)
    valid = b.Less(b.Unsqueeze(column, b.ints([0])), b.Unsqueeze(lengths, b.ints([1])))
    rows = b.Add(b.Unsqueeze(starts, b.ints([1])), b.Unsqueeze(column, b.ints([0])))
    rows = b.Where(valid, rows, b.ints([0]))
    return b.Gather(packed, rows, axis=0), valid


def _unpad_queries(
    b: Builder, padded: str, starts: str, ends: str, max_q: str, query: str, output: str
) -> str:
    """The packed [T, H, D] rows of a padded [S, max_q, H, D] result, cast like ``query``."""
    num_tokens = b.Shape(query, start=0, end=1)
    token = _arange(b, num_tokens)
    # Sequence of token t = number of sequences that end at or before t (empty ones included).
    ended = b.LessOrEqual(b.Unsqueeze(ends, b.ints([0])), b.Unsqueeze(token, b.ints([1])))
    seq_of_token = b.ReduceSum(b.Cast(ended, to=INT64), b.ints([1]), keepdims=0)
    index_in_seq = b.Sub(token, b.Gather(starts, seq_of_token, axis=0))
    row = b.Add(b.Mul(seq_of_token, max_q), index_in_seq)
    flat = b.Reshape(padded, b.Concat(b.ints([-1]), b.Shape(query, start=1), axis=0))
    return b.op("CastLike", b.Gather(flat, row, axis=0), query, names=[output])


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


def _alibi(b: Builder, logits: str, slopes: str, distance: str, kv_heads: str, group: str) -> str:
    """logits [S, Hkv, G, Q, L] + slopes[h] * (k - p), with ``distance`` = k - p [S, Q, L]."""
    biased = b.branch()
    shape = biased.Concat(biased.ints([1]), kv_heads, group, biased.ints([1, 1]), axis=0)
    per_head = biased.Reshape(biased.Cast(slopes, to=FLOAT), shape)  # [1, Hkv, G, 1, 1]
    bias = biased.Mul(per_head, biased.Unsqueeze(distance, biased.ints([1, 2])))
    then_out = biased.Add(logits, bias)
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
    key: str,
    value: str,
    positions: str,
    query_valid: str,
    key_lens: str,
    key_positions: str,
    slopes: str,
) -> str:
    """Masked grouped-query attention of a padded batch, in float32.

    query [S, Q, H, D]; key/value [S, L, Hkv, D]; positions (absolute, of the queries) and
    query_valid [S, Q]; key_lens [S]; key_positions [L] = 0..L-1. Returns [S, Q, H, D] float32.
    """
    q = b.Cast(query, to=FLOAT)
    k = b.Cast(key, to=FLOAT)
    v = b.Cast(value, to=FLOAT)
    num_q = b.Shape(q, start=1, end=2)
    heads = b.Shape(q, start=2, end=3)
    head_size = b.Shape(q, start=3, end=4)
    kv_heads = b.Shape(k, start=2, end=3)
    num_keys = b.Shape(k, start=1, end=2)
    group = b.Div(heads, kv_heads)
    rows = b.Mul(group, num_q)
    batch = b.Shape(q, start=0, end=1)

    def reshape(x, *dims):
        # Explicit sizes with allowzero=1: a computed size of 0 (no queries, no keys) must mean
        # 0, not "copy the input's dimension".
        return b.Reshape(x, b.Concat(batch, *dims, axis=0), allowzero=1)

    # Rows of one KV head's matrix are (query head in the group, query token): head h uses
    # KV head h // group, as in the reference's repeat_interleave.
    q5 = reshape(q, num_q, kv_heads, group, head_size)  # [S, Q, Hkv, G, D]
    q4 = reshape(b.Transpose(q5, perm=[0, 2, 3, 1, 4]), kv_heads, rows, head_size)
    logits = b.MatMul(q4, b.Transpose(k, perm=[0, 2, 3, 1]))  # [S, Hkv, G*Q, L]
    logits = b.Mul(logits, b.attribute("scale", "float"))
    logits = reshape(logits, kv_heads, group, num_q, num_keys)
    logits = _soft_cap(b, logits)

    p = b.Unsqueeze(positions, b.ints([2]))  # [S, Q, 1]
    distance = b.Cast(b.Sub(key_positions, p), to=FLOAT)  # k - p, [S, Q, L]
    logits = _alibi(b, logits, slopes, distance, kv_heads, group)

    in_sequence = b.Less(key_positions, b.Unsqueeze(key_lens, b.ints([1])))  # [S, L]
    causal = b.Cast(b.attribute("causal", "int"), to=BOOL)
    window = b.attribute("sliding_window", "int")
    causal_ok = b.Or(b.Not(causal), b.LessOrEqual(key_positions, p))
    window_ok = b.Or(b.Less(window, b.int_scalar(0)), b.Less(b.Sub(p, key_positions), window))
    visible = b.And(b.And(causal_ok, window_ok), b.Unsqueeze(in_sequence, b.ints([1])))
    visible = b.And(visible, b.Unsqueeze(query_valid, b.ints([2])))  # [S, Q, L]

    neg_inf = b.float_scalar(float("-inf"))
    masked = b.Where(b.Unsqueeze(visible, b.ints([1, 2])), logits, neg_inf)
    weights = b.Softmax(masked, axis=-1)
    # A row with no visible key is all -inf (softmax NaN): the contract gives it zeros.
    has_key = b.ReduceMax(b.Cast(visible, to=FLOAT), b.ints([-1]), keepdims=1)  # [S, Q, 1]
    has_key = b.Unsqueeze(b.Greater(has_key, b.float_scalar(0.0)), b.ints([1, 2]))
    zero = b.float_scalar(0.0)
    weights = b.Where(has_key, weights, zero)
    # Slots past a sequence's end hold stale or uninitialised data: zero them so that a NaN
    # there cannot leak through a zero weight (0 * NaN = NaN).
    v = b.Where(b.Unsqueeze(in_sequence, b.ints([2, 3])), v, zero)

    weights = reshape(weights, kv_heads, rows, num_keys)
    out = b.MatMul(weights, b.Transpose(v, perm=[0, 2, 1, 3]))  # [S, Hkv, G*Q, D]
    out = reshape(out, kv_heads, group, num_q, head_size)
    out = b.Transpose(out, perm=[0, 3, 1, 2, 4])  # [S, Q, Hkv, G, D]
    return reshape(out, num_q, heads, head_size)


# --------------------------------------------------------------------------- the three bodies


def reshape_and_cache(opset: int) -> onnx.FunctionProto:
    """``attnexport.ReshapeAndCache`` in standard ops (NonZero + Gather + ScatterND)."""
    b = Builder()
    slots = b.Cast("slot_mapping", to=INT64)
    # Rows with a slot >= 0 (Gather, not Compress: Compress's schema has no bfloat16).
    kept = b.Squeeze(b.NonZero(b.GreaterOrEqual(slots, b.ints([0]))), b.ints([0]))
    slots = b.Gather(slots, kept, axis=0)
    block_size = b.Shape("key_cache", start=1, end=2)
    blocks = b.Unsqueeze(b.Div(slots, block_size), b.ints([1]))
    offsets = b.Unsqueeze(b.Mod(slots, block_size), b.ints([1]))
    index = b.Concat(blocks, offsets, axis=1)  # [T', 2] = (block, offset)
    for token, cache in (("key", "key_cache"), ("value", "value_cache")):
        b.op("ScatterND", cache, index, b.Gather(token, kept, axis=0), names=[f"{cache}_out"])
    return function(
        b,
        "ReshapeAndCache",
        DOMAIN,
        ["key", "value", "key_cache", "value_cache", "slot_mapping"],
        ["key_cache_out", "value_cache_out"],
        opset,
        {},
        doc="Writes key/value into the paged caches; negative slots are skipped.",
    )


_MASK_ATTRIBUTES = {"scale": None, "sliding_window": -1, "logits_soft_cap": 0.0}


def paged_attention(opset: int) -> onnx.FunctionProto:
    """``attnexport.PagedAttention`` in standard ops."""
    b = Builder()
    starts, ends, query_lens = _offsets(b, "query_start_loc")
    seq_lens = b.Cast("seq_lens", to=INT64)
    max_q = _max_or_zero(b, query_lens)
    query, query_valid = _pad_rows(b, "query", starts, query_lens, max_q)
    positions = b.Add(
        b.Unsqueeze(b.Sub(seq_lens, query_lens), b.ints([1])),
        b.Unsqueeze(_arange(b, max_q), b.ints([0])),
    )

    # Keys: the blocks of each sequence; table entries past its last block may be padding
    # (any value), so they read block 0 instead and are masked.
    block_size = b.Shape("key_cache", start=1, end=2)
    max_blocks = b.Shape("block_tables", start=1, end=2)
    blocks_used = b.Div(b.Sub(b.Add(seq_lens, block_size), b.ints([1])), block_size)
    column = b.Unsqueeze(_arange(b, max_blocks), b.ints([0]))
    in_use = b.Less(column, b.Unsqueeze(blocks_used, b.ints([1])))
    table = b.Where(in_use, b.Cast("block_tables", to=INT64), b.ints([0]))
    num_keys = b.Mul(max_blocks, block_size)
    num_seqs = b.Shape("block_tables", start=0, end=1)
    kv_shape = b.Concat(num_seqs, num_keys, b.Shape("key_cache", start=2), axis=0)
    key = b.Reshape(b.Gather("key_cache", table, axis=0), kv_shape, allowzero=1)  # [S, L, Hkv, D]
    value = b.Reshape(b.Gather("value_cache", table, axis=0), kv_shape, allowzero=1)

    out = _attend(
        b,
        query,
        key,
        value,
        positions,
        query_valid,
        seq_lens,
        _arange(b, num_keys),
        "alibi_slopes",
    )
    _unpad_queries(b, out, starts, ends, max_q, "query", "output")
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
        {**_MASK_ATTRIBUTES, "causal": 1},
        doc="Attention of packed ragged queries over a paged KV cache.",
    )


def varlen_attention(opset: int) -> onnx.FunctionProto:
    """``attnexport.VarlenAttention`` in standard ops."""
    b = Builder()
    q_starts, q_ends, query_lens = _offsets(b, "cu_seqlens_q")
    k_starts, _, key_lens = _offsets(b, "cu_seqlens_k")
    max_q = _max_or_zero(b, query_lens)
    max_k = _max_or_zero(b, key_lens)
    query, query_valid = _pad_rows(b, "query", q_starts, query_lens, max_q)
    key, _ = _pad_rows(b, "key", k_starts, key_lens, max_k)
    value, _ = _pad_rows(b, "value", k_starts, key_lens, max_k)
    positions = b.Add(
        b.Unsqueeze(b.Sub(key_lens, query_lens), b.ints([1])),
        b.Unsqueeze(_arange(b, max_q), b.ints([0])),
    )
    out = _attend(
        b,
        query,
        key,
        value,
        positions,
        query_valid,
        key_lens,
        _arange(b, max_k),
        "alibi_slopes",
    )
    _unpad_queries(b, out, q_starts, q_ends, max_q, "query", "output")
    return function(
        b,
        "VarlenAttention",
        DOMAIN,
        ["query", "key", "value", "cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"],
        ["output"],
        opset,
        {**_MASK_ATTRIBUTES, "causal": 0},
        doc="Attention over packed ragged sequences without a cache.",
    )


def all_bodies(opset: int) -> list[onnx.FunctionProto]:
    """The bodies of every attnexport node, for a model of standard opset ``opset`` (>= 18)."""
    if opset < 18:
        raise ValueError(f"opset: expected a standard ONNX opset >= 18, got {opset}")
    return [reshape_and_cache(opset), paged_attention(opset), varlen_attention(opset)]
