"""The attnexport ops (namespace ``attnexport``), with fake kernels for tracing.

Each op validates its inputs (:mod:`.validation`), describes the call (:class:`AttentionCall`),
and runs it on the backend chosen by :func:`select_backend`. The contract is docs/ops.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from attnexport.custom_ops import validation
from attnexport.custom_ops.dispatch import AttentionCall, select_backend

_LIB = torch.library.Library("attnexport", "DEF")


def _op(schema: str) -> Callable[[Callable], Callable]:
    """Defines ``attnexport::<name><schema>`` (name: the decorated function's) with that
    function as its kernel on every device, and returns a function of the same signature and
    docstring that calls the op through the dispatcher, which is what torch.export records.

    The low-level registration, like vLLM's ``direct_register_custom_op``: ``torch.library.
    custom_op`` adds an autograd wrapper and a dynamo-disabled frame to every call, several times
    the dispatcher's cost (docs/benchmarks.md, "Measured design choices"). In-place
    ops declare what they write in the schema (``Tensor(a!)``)."""

    def register(kernel: Callable) -> Callable:
        name = kernel.__name__
        _LIB.define(name + schema)
        _LIB.impl(name, _without_grad(kernel), "CompositeExplicitAutograd")
        packet = getattr(torch.ops.attnexport, name)

        @functools.wraps(kernel)
        def call(*args, **kwargs):
            return packet(*args, **kwargs)

        return call

    return register


def _without_grad(kernel: Callable) -> Callable:
    """``kernel`` recording no autograd history: the ops have no derivative, and a model run
    outside ``no_grad`` (parameters that require grad) must still run them (some kernels write
    into ``out=`` buffers, which autograd refuses). A context is entered only when grad mode is
    on: the engine's steps run under ``no_grad`` and pay one check."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return kernel(*args, **kwargs)
        return kernel(*args, **kwargs)

    return run


def _fake(name: str) -> Callable[[Callable], Callable]:
    """Registers the decorated function as the fake (meta) kernel of ``attnexport::<name>``:
    shapes and dtypes only, for tracing."""
    return torch.library.register_fake(f"attnexport::{name}", lib=_LIB)


def _is_standard_layout(cache: torch.Tensor) -> bool:
    return cache.is_contiguous()


def _paged_call(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
    summary: validation.BatchSummary,
) -> AttentionCall:
    return AttentionCall(
        op="paged_attention",
        device_type=query.device.type,
        dtype=query.dtype,
        num_heads=query.shape[1],
        num_kv_heads=key_cache.shape[2],
        head_size=query.shape[2],
        block_size=key_cache.shape[1],
        causal=causal,
        alibi=alibi_slopes is not None,
        sliding_window=sliding_window >= 0,
        soft_cap=logits_soft_cap > 0,
        decode_only=summary.decode_only,
        chunked_prefill=summary.has_context,
        cache_contiguous=_is_standard_layout(key_cache),
    )


def _write_call(key: torch.Tensor, key_cache: torch.Tensor) -> AttentionCall:
    return AttentionCall(
        op="reshape_and_cache",
        device_type=key.device.type,
        dtype=key.dtype,
        num_heads=key.shape[1],
        num_kv_heads=key.shape[1],
        head_size=key.shape[2],
        block_size=key_cache.shape[1],
        cache_contiguous=_is_standard_layout(key_cache),
    )


# --------------------------------------------------------------------------- reshape_and_cache


_WRITE_ARGS = (
    "Tensor key, Tensor value, Tensor{} key_cache, Tensor{} value_cache, Tensor slot_mapping"
)
_MASK_ARGS = (
    "float scale, bool causal={}, Tensor? alibi_slopes=None, int sliding_window=-1, "
    "float logits_soft_cap=0.0"
)


@_op(f"({_WRITE_ARGS.format('(a!)', '(b!)')}) -> ()")
def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes new keys and values into the paged caches, in place.

    Args:
        key, value: ``[T, Hkv, D]``, the cache dtype.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``; written in place.
        slot_mapping: ``[T]`` int32 or int64. Token t goes to block ``slot // block_size``,
            offset ``slot % block_size``; a negative slot marks a padding token (skipped).
    """
    validation.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    backend = select_backend(_write_call(key, key_cache))
    backend.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@_fake("reshape_and_cache")
def _(key, value, key_cache, value_cache, slot_mapping) -> None:
    validation.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@_op(f"({_WRITE_ARGS.format('', '')}) -> (Tensor, Tensor)")
def reshape_and_cache_functional(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The functional twin of :func:`reshape_and_cache`, used by the lowering.

    Same arguments; the caches are left untouched and the written copies
    ``(new_key_cache, new_value_cache)`` are returned.
    """
    validation.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    new_key_cache, new_value_cache = key_cache.clone(), value_cache.clone()
    backend = select_backend(_write_call(key, new_key_cache))
    backend.reshape_and_cache(key, value, new_key_cache, new_value_cache, slot_mapping)
    return new_key_cache, new_value_cache


@_fake("reshape_and_cache_functional")
def _(key, value, key_cache, value_cache, slot_mapping):
    validation.check_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    return torch.empty_like(key_cache), torch.empty_like(value_cache)


# --------------------------------------------------------------------------- paged_attention


@_op(
    "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    f"Tensor seq_lens, Tensor query_start_loc, {_MASK_ARGS.format('True')}) -> Tensor"
)
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of packed ragged queries over a paged KV cache (prefill, decode, chunked
    prefill, mixed batches, and non-causal cross-attention).

    Args:
        query: ``[T, H, D]`` floating point.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, dtype of query;
            H must be a multiple of Hkv (grouped-query attention).
        block_tables: ``[S, max_blocks_per_seq]`` int32, the blocks of each sequence in order.
        seq_lens: ``[S]`` int32, the KV length of each sequence (cached + new, already written).
        query_start_loc: ``[S + 1]`` int32 cumulative query counts; ``[-1] == T``.
        scale: multiplies ``q . k``.
        causal: query j of sequence i sits at ``p = seq_lens[i] - q_i + j`` and sees keys
            ``k <= p``; False lets every query see all ``seq_lens[i]`` keys.
        alibi_slopes: optional ``[H]`` float; adds ``slope[h] * (k - p)`` (in fp32).
        sliding_window: if >= 0, key k is visible only when ``p - k < sliding_window``.
        logits_soft_cap: if > 0, logits become ``cap * tanh(logits / cap)`` before ALiBi.

    Returns:
        ``[T, H, D]`` in the dtype of query; a query that sees no key gets zeros.
    """
    summary = validation.check_paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )
    if query.shape[0] == 0:
        return torch.empty_like(query)
    call = _paged_call(
        query, key_cache, causal, alibi_slopes, sliding_window, logits_soft_cap, summary
    )
    return select_backend(call).paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )


@_fake("paged_attention")
def _(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    causal=True,
    alibi_slopes=None,
    sliding_window=-1,
    logits_soft_cap=0.0,
):
    validation.check_paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )
    return torch.empty_like(query)


# --------------------------------------------------------------------------- varlen_attention


@_op(
    "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    f"{_MASK_ARGS.format('False')}) -> Tensor"
)
def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Attention over packed ragged sequences without a cache (encoders, cross-attention at
    prefill).

    Args:
        query: ``[Tq, H, D]``; key, value: ``[Tk, Hkv, D]`` of the same dtype.
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 cumulative lengths.
        scale, causal, alibi_slopes, sliding_window, logits_soft_cap: as in
            :func:`paged_attention`, with query j of a sequence of q queries and k keys at
            position ``p = k - q + j`` (aligned to the end of the keys, "bottom-right").

    Returns:
        ``[Tq, H, D]`` in the dtype of query; a query that sees no key gets zeros.
    """
    summary = validation.check_varlen_attention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )
    if query.shape[0] == 0:
        return torch.empty_like(query)
    call = AttentionCall(
        op="varlen_attention",
        device_type=query.device.type,
        dtype=query.dtype,
        num_heads=query.shape[1],
        num_kv_heads=key.shape[1],
        head_size=query.shape[2],
        causal=causal,
        alibi=alibi_slopes is not None,
        sliding_window=sliding_window >= 0,
        soft_cap=logits_soft_cap > 0,
        decode_only=summary.decode_only,
        chunked_prefill=summary.has_context,
    )
    return select_backend(call).varlen_attention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )


@_fake("varlen_attention")
def _(
    query,
    key,
    value,
    cu_seqlens_q,
    cu_seqlens_k,
    scale,
    causal=False,
    alibi_slopes=None,
    sliding_window=-1,
    logits_soft_cap=0.0,
):
    validation.check_varlen_attention(
        query,
        key,
        value,
        cu_seqlens_q,
        cu_seqlens_k,
        scale,
        causal,
        alibi_slopes,
        sliding_window,
        logits_soft_cap,
    )
    return torch.empty_like(query)


# --------------------------------------------------------------------------- rotary_embedding


@_op("(Tensor x, Tensor cos, Tensor sin) -> Tensor")
def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, "rotate half" (GPT-NeoX, Llama) layout, of every head.

    One op instead of the ~7 elementwise nodes of the written-out formula, so that an exported
    graph can run it as one fused kernel (the native onnxruntime kernels do).

    Args:
        x: ``[T, H, D]`` floating point (queries and keys may share one call), D even.
        cos, sin: ``[T, D]`` in the dtype of x: the tables of each token's position.

    Returns:
        ``[T, H, D]`` in the dtype of x: ``x * cos + rotate_half(x) * sin``, with
        ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, computed in that dtype.
    """
    validation.check_rotary_embedding(x, cos, sin)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x ``[T, H, D]``, tables ``[T, D]``: a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@_fake("rotary_embedding")
def _(x, cos, sin):
    validation.check_rotary_embedding(x, cos, sin)
    return torch.empty_like(x)


@_op(
    "(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) "
    "-> (Tensor, Tensor, Tensor)"
)
def qkv_rotary_embedding(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heads of a fused q/k/v projection, with :func:`rotary_embedding` applied to the
    query and key heads: one op (one node of an exported graph) instead of a reshape, two
    splits and the rotation.

    Args:
        qkv: ``[T, (H + 2 * Hkv) * D]`` floating point: H query heads, then Hkv key heads,
            then Hkv value heads, each D wide (D even, the width of the tables).
        cos, sin: ``[T, D]`` in the dtype of qkv.
        num_heads, num_kv_heads: H and Hkv (positive).

    Returns:
        ``(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D])`` in the dtype of qkv, new
        tensors: query and key rotated as by :func:`rotary_embedding`, value copied.
    """
    validation.check_qkv_rotary_embedding(qkv, cos, sin, num_heads, num_kv_heads)
    heads = qkv.unflatten(1, (num_heads + 2 * num_kv_heads, cos.shape[1]))
    query, key, value = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    # Outputs of a custom op must not alias its inputs or each other: three new tensors.
    return _rotate(query, cos, sin), _rotate(key, cos, sin), value.clone()


@_fake("qkv_rotary_embedding")
def _(qkv, cos, sin, num_heads, num_kv_heads):
    validation.check_qkv_rotary_embedding(qkv, cos, sin, num_heads, num_kv_heads)
    tokens, head_size = qkv.shape[0], cos.shape[1]
    return (
        qkv.new_empty(tokens, num_heads, head_size),
        qkv.new_empty(tokens, num_kv_heads, head_size),
        qkv.new_empty(tokens, num_kv_heads, head_size),
    )


# --------------------------------------------------------------------------- silu_and_mul


@_op("(Tensor x) -> Tensor")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(x[:, :d]) * x[:, d:]`` (the halves of a fused gate/up projection).

    One op instead of a split, a sigmoid and two products, so that an exported graph runs it
    as one kernel (the native onnxruntime kernels do), like vLLM's op of the same name.

    Args:
        x: ``[T, 2 * d]`` floating point.

    Returns:
        ``[T, d]`` in the dtype of x (silu, then the product, each rounded to that dtype).
    """
    validation.check_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@_fake("silu_and_mul")
def _(x):
    validation.check_silu_and_mul(x)
    return x.new_empty(x.shape[0], x.shape[1] // 2)


# --------------------------------------------------------------------------- fused_add_rms_norm


@_op("(Tensor x, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)")
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add followed by Llama's RMSNorm, as one op (vLLM's ``fused_add_rms_norm``,
    without its in-place writes): one node of an exported graph instead of an Add and a norm.

    Args:
        x: ``[T, hidden]`` floating point, the block's output.
        residual: ``[T, hidden]`` in the dtype of x, the residual stream.
        weight: ``[hidden]`` in the dtype of x.
        epsilon: added to the mean square.

    Returns:
        ``(normed, total)``, both ``[T, hidden]`` in the dtype of x: ``total = x + residual``
        (rounded to that dtype) and ``normed = weight * (t / sqrt(mean(t^2) + epsilon))`` with
        ``t`` = total in float32 (float64 too), the quotient rounded to the dtype before the
        weight is applied (transformers' LlamaRMSNorm).
    """
    validation.check_fused_add_rms_norm(x, residual, weight)
    total = x + residual
    t = total.float()
    normed = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * normed.to(x.dtype), total


@_fake("fused_add_rms_norm")
def _(x, residual, weight, epsilon):
    validation.check_fused_add_rms_norm(x, residual, weight)
    return torch.empty_like(x), torch.empty_like(x)
