"""Translation of the attnexport torch ops into ``attnexport``-domain ONNX nodes.

:func:`translation_table` is the ``custom_translation_table`` handed to
``torch.onnx.export``. Only the functional ops are translated: the in-place
``attnexport::reshape_and_cache`` is rewritten to ``reshape_and_cache_functional`` first
(:mod:`attnexport.lowering.passes`), because torch.onnx cannot lower in-place custom ops.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
import torch
from onnxscript import opset18 as op
from onnxscript.values import Opset

from attnexport.lowering.schemas import DOMAIN, DOMAIN_VERSION, register_schemas

register_schemas()
_attnexport = Opset(DOMAIN, DOMAIN_VERSION)


def _slopes_or_zeros(query, alibi_slopes):
    """float32 [num_heads] slopes; zeros when the model has no ALiBi (bodies need the input)."""
    if alibi_slopes is None:
        zero = onnx.helper.make_tensor("zero", onnx.TensorProto.FLOAT, [1], [0.0])
        return op.ConstantOfShape(op.Shape(query, start=1, end=2), value=zero)
    return op.Cast(alibi_slopes, to=onnx.TensorProto.FLOAT)


def _mask_attributes(scale, causal, sliding_window, logits_soft_cap) -> dict:
    return {
        "scale": float(scale),
        "causal": int(bool(causal)),
        "sliding_window": int(sliding_window),
        "logits_soft_cap": float(logits_soft_cap),
    }


def reshape_and_cache_functional(key, value, key_cache, value_cache, slot_mapping):
    """attnexport::reshape_and_cache_functional(Tensor key, Tensor value, Tensor key_cache,
    Tensor value_cache, Tensor slot_mapping) -> (Tensor, Tensor)"""
    return _attnexport.ReshapeAndCache(key, value, key_cache, value_cache, slot_mapping, _outputs=2)


def paged_attention(
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
):
    """attnexport::paged_attention(...) -> Tensor"""
    return _attnexport.PagedAttention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        _slopes_or_zeros(query, alibi_slopes),
        **_mask_attributes(scale, causal, sliding_window, logits_soft_cap),
    )


def varlen_attention(
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
    return _attnexport.VarlenAttention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        _slopes_or_zeros(query, alibi_slopes),
        **_mask_attributes(scale, causal, sliding_window, logits_soft_cap),
    )


def translation_table() -> dict[Callable, Callable]:
    """``{torch op overload: translation}`` for ``torch.onnx.export(custom_translation_table=)``."""
    ops = torch.ops.attnexport
    return {
        ops.reshape_and_cache_functional.default: reshape_and_cache_functional,
        ops.paged_attention.default: paged_attention,
        ops.varlen_attention.default: varlen_attention,
    }
