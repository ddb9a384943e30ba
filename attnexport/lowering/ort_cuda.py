"""The ``ort-cuda`` target: onnxruntime's ``com.microsoft.PagedAttention`` (CUDA EP).

That contrib op writes the new tokens into the caches and attends in one node, so a pair
``ReshapeAndCache -> PagedAttention`` (the attention reading the caches the write produced)
maps onto it::

    com.microsoft.PagedAttention(
        query [T, H*D], key [T, Hkv*D], value [T, Hkv*D], key_cache, value_cache,
        cumulative_sequence_length = query_start_loc,
        past_seqlens = seq_lens - query_lens,
        block_table = block_tables,
        slot_mapping = max(int32(slot_mapping), -1))   # negative slots -> -1, "skip";
                                                     # past int32: the run fails
      -> output [T, H*D], key_cache_out, value_cache_out   (the caches, aliased in place)

with attributes ``num_heads``, ``kv_num_heads``, ``scale``, ``softcap`` = logits_soft_cap,
``is_causal`` = causal and ``local_window_size`` = sliding_window: the contrib op's window is
the same count of keys as ours (p - k < window), unlike GroupQueryAttention's
``local_window_size`` (p - k <= w). Measured on onnxruntime 1.31.1's CUDA kernel (H200): with
``sliding_window - 1`` every sequence longer than the window differed from the reference; with
``sliding_window`` every context length 1..130 matched, for windows 7 and 40.

A node is left as an attnexport node (running its standard-op body, also on the CUDA EP) when
the contrib op cannot express it: fp32/fp64 dtypes (it takes fp16/bf16), ALiBi (no slope
input), a read-only attention (it always writes), a window of 1, non-static head counts, a block
size that is not a power of two of at least 16 (the CUDA kernel refuses it at run time), or a
write whose tokens are not the query tokens. The reasons are returned as notes.

The mapping is one onnxscript rewrite rule: the pattern (write -> attention), the check (what
the contrib op can express) and the replacement.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from attnexport.lowering.registry import DOMAIN

MS_DOMAIN = "com.microsoft"
_HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_MAPPED_ELSEWHERE = "its cache write feeds another attention already mapped"


def _attribute(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def _is_zero(value: ir.Value | None) -> bool:
    """True for absent or all-zero ALiBi slopes (what the exporter passes without ALiBi)."""
    if value is None:
        return True
    producer = value.producer()
    if producer is not None and producer.op_type == "ConstantOfShape":
        fill = producer.attributes.get("value")
        return fill is None or not np.any(fill.value.numpy())
    tensor = ir.convenience.get_const_tensor(value)
    return tensor is not None and not np.any(tensor.numpy())


def _static(value: ir.Value, index: int) -> int | None:
    shape = value.shape
    if shape is None or len(shape) <= index or not isinstance(shape[index], int):
        return None
    return shape[index]


def _why_not(attention: ir.Node, write: ir.Node | None) -> str | None:
    query = attention.inputs[0]
    if write is None:
        return "its caches are not written by a ReshapeAndCache in the same graph"
    if query.dtype not in _HALF:
        return f"dtype {query.dtype} (com.microsoft.PagedAttention takes float16/bfloat16)"
    if None in (_static(query, 1), _static(query, 2), _static(attention.inputs[1], 2)):
        return "num_heads, head_size or num_kv_heads is not static"
    if not _is_zero(attention.inputs[6] if len(attention.inputs) > 6 else None):
        return "ALiBi (com.microsoft.PagedAttention has no slope input)"
    if len(attention.inputs) > 9 and attention.inputs[9] is not None:
        return "attention sinks (com.microsoft.PagedAttention has no sink input)"
    if _attribute(attention, "sliding_window", -1) == 1:
        return "sliding_window=1 (a one-key window was not checked against the CUDA kernel)"
    block_size = _static(attention.inputs[1], 1)
    if block_size is None or block_size < 16 or block_size & (block_size - 1):
        # onnxruntime 1.31's CUDA kernel refuses the run otherwise ("block_size must be a
        # power of two and at least 16"), measured on an H200.
        return f"block_size={block_size} (com.microsoft.PagedAttention needs a power of two >= 16)"
    key = write.inputs[0]
    if key.shape is None or query.shape is None or key.shape[0] != query.shape[0]:
        return "the written tokens are not known to be the query tokens"
    return None


def _writer(attention: ir.Node) -> ir.Node | None:
    """The ReshapeAndCache whose outputs are the attention's caches, if any."""
    key_cache, value_cache = attention.inputs[1], attention.inputs[2]
    node = key_cache.producer()
    if node is None or node.domain != DOMAIN or node.op_type != "ReshapeAndCache":
        return None
    if node.outputs[0] is not key_cache or node.outputs[1] is not value_cache:
        return None
    return node


def _write_then_attend(
    op, query, key, value, key_cache, value_cache, slot_mapping, block_tables, seq_lens, offsets
):
    """The pattern: an attention reading both caches a write produced."""
    key_cache_out, value_cache_out = op.ReshapeAndCache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        _domain=DOMAIN,
        _outputs=["key_cache_out", "value_cache_out"],
    )
    output = op.PagedAttention(
        query,
        key_cache_out,
        value_cache_out,
        block_tables,
        seq_lens,
        offsets,
        _domain=DOMAIN,
        _allow_other_inputs=True,  # the ALiBi slopes, checked to be zeros
        _outputs=["output"],
    )
    return output, key_cache_out, value_cache_out


def _mappable(context, output: ir.Value, key_cache_out: ir.Value, **_) -> pattern.MatchResult:
    """The check: the contrib op can compute this pair (else the reason, see the notes)."""
    result = pattern.MatchResult()
    reason = _why_not(output.producer(), key_cache_out.producer())
    return result.fail(reason) if reason else result


def _int32_slots(op, slots: ir.Value) -> ir.Value:
    """``slots`` (int32 or int64 [T]) in int64 with every negative slot -> -1, ready for an
    exact Cast to int32: a slot past int32 fails the run instead of wrapping (2^32 + 5 would
    write slot 5). The failure is a ``Gather`` whose index is the count of such slots, on a
    1-row copy (ONNX has no assert; onnxruntime refuses an index past the end and names the
    node, ``invalid_slot_mapping``), as the function bodies' metadata checks do."""
    slots = op.Cast(slots, to=ir.DataType.INT64)
    too_big = op.Greater(slots, _constant(op, [2**31 - 1], np.int64))
    count = op.ReduceSum(op.Cast(too_big, to=ir.DataType.INT64), keepdims=0)
    unsqueezed = op.Unsqueeze(slots, _constant(op, [0], np.int64))
    checked = op.Gather(unsqueezed, count, axis=0, _name="invalid_slot_mapping")
    return op.Max(checked, _constant(op, -1, np.int64))


def _constant(op, values, dtype) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype=dtype)))


def _contrib_attention(op, query, key, value, key_cache, value_cache, output, **match):
    """The replacement: one com.microsoft.PagedAttention (module doc)."""
    attention = output.producer()
    slot_mapping, block_tables, seq_lens, offsets = (
        match[name] for name in ("slot_mapping", "block_tables", "seq_lens", "offsets")
    )
    flat = _constant(op, [0, -1], np.int64)  # [T, heads * head_size]
    # query_start_loc [S + 1] -> the query counts ends - starts
    starts = op.Slice(offsets, _constant(op, [0], np.int64), _constant(op, [-1], np.int64))
    ends = op.Slice(offsets, _constant(op, [1], np.int64), _constant(op, [2**62], np.int64))
    past = op.Sub(seq_lens, op.Sub(ends, starts))
    slots32 = op.Max(
        op.Cast(_int32_slots(op, slot_mapping), to=ir.DataType.INT32),
        _constant(op, -1, np.int32),
    )
    window = _attribute(attention, "sliding_window", -1)
    outputs = op.PagedAttention(
        op.Reshape(query, flat),
        op.Reshape(key, flat),
        op.Reshape(value, flat),
        key_cache,
        value_cache,
        offsets,
        past,
        block_tables,
        None,  # cos_cache
        None,  # sin_cache
        slots32,
        num_heads=_static(query, 1),
        kv_num_heads=_static(key_cache, 2),
        scale=float(_attribute(attention, "scale", 1.0)),
        softcap=float(_attribute(attention, "logits_soft_cap", 0.0)),
        is_causal=int(_attribute(attention, "causal", 1)),
        local_window_size=window,
        _domain=MS_DOMAIN,
        _outputs=3,
    )
    int32 = ir.TensorType(ir.DataType.INT32)
    for int32_value in (starts, ends, past, slots32):
        int32_value.type = int32
    outputs[0].type = query.type
    return op.Reshape(outputs[0], op.Shape(query)), outputs[1], outputs[2]


_RULES = pattern.RewriteRuleSet(
    [pattern.RewriteRule(_write_then_attend, _contrib_attention, _mappable)]
)


def map_paged_attention(model: ir.Model) -> list[str]:
    """Replaces every mappable write + attention pair (module doc); returns why the other
    PagedAttention nodes stay attnexport nodes."""
    if _RULES.apply_to_model(model):
        model.opset_imports[MS_DOMAIN] = 1
    notes = []
    for node in model.graph:
        if node.domain != DOMAIN or node.op_type != "PagedAttention":
            continue
        producer = node.inputs[1].producer()
        if producer is not None and producer.domain == MS_DOMAIN:
            reason = _MAPPED_ELSEWHERE
        else:
            reason = _why_not(node, _writer(node)) or "not matched"
        notes.append(f"PagedAttention '{node.name}' kept with its body: {reason}")
    return notes
