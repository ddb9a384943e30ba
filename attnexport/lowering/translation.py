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


def _static(tensor, axis: int, name: str) -> int:
    """Dimension ``axis`` of a traced value; it must be static (the nodes take it as an
    attribute, see :mod:`attnexport.lowering.schemas`)."""
    shape = getattr(tensor, "shape", None)
    dim = shape[axis] if shape is not None and axis < len(shape) else None
    if not isinstance(dim, int):
        raise ValueError(
            f"{name}: expected a static dimension {axis} for the ONNX export, got {dim!r} "
            f"(shape {shape}); heads, head size and block size cannot be dynamic"
        )
    return dim


def _geometry(query, key, kv_heads_axis: int) -> dict:
    """The geometry attributes of an attention node (see the schemas)."""
    return {
        "num_heads": _static(query, 1, "query"),
        "num_kv_heads": _static(key, kv_heads_axis, "key"),
        "head_size": _static(query, 2, "query"),
    }


def reshape_and_cache_functional(key, value, key_cache, value_cache, slot_mapping):
    """attnexport::reshape_and_cache_functional(Tensor key, Tensor value, Tensor key_cache,
    Tensor value_cache, Tensor slot_mapping) -> (Tensor, Tensor)"""
    return _attnexport.ReshapeAndCache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        block_size=_static(key_cache, 1, "key_cache"),
        _outputs=2,
    )


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
        **_geometry(query, key_cache, 2),
        block_size=_static(key_cache, 1, "key_cache"),
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
        **_geometry(query, key, 1),
    )


def rotary_embedding(x, cos, sin):
    """attnexport::rotary_embedding(Tensor x, Tensor cos, Tensor sin) -> Tensor"""
    return _attnexport.NeoxRotaryEmbedding(x, cos, sin)


def qkv_rotary_embedding(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """attnexport::qkv_rotary_embedding(Tensor qkv, Tensor cos, Tensor sin, int num_heads,
    int num_kv_heads) -> (Tensor, Tensor, Tensor)"""
    return _attnexport.NeoxQKVRotaryEmbedding(
        qkv,
        cos,
        sin,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=_static(cos, 1, "cos"),
        _outputs=3,
    )


def silu_and_mul(x):
    """attnexport::silu_and_mul(Tensor x) -> Tensor"""
    return _attnexport.SiluAndMul(x)


def fused_add_rms_norm(x, residual, weight, epsilon: float):
    """attnexport::fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float epsilon)
    -> (Tensor, Tensor)"""
    return _attnexport.FusedAddRMSNorm(x, residual, weight, epsilon=float(epsilon), _outputs=2)


def translation_table() -> dict[Callable, Callable]:
    """``{torch op overload: translation}`` for ``torch.onnx.export(custom_translation_table=)``."""
    ops = torch.ops.attnexport
    return {
        ops.reshape_and_cache_functional.default: reshape_and_cache_functional,
        ops.paged_attention.default: paged_attention,
        ops.varlen_attention.default: varlen_attention,
        ops.rotary_embedding.default: rotary_embedding,
        ops.qkv_rotary_embedding.default: qkv_rotary_embedding,
        ops.silu_and_mul.default: silu_and_mul,
        ops.fused_add_rms_norm.default: fused_add_rms_norm,
    }
