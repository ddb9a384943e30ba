"""``varlen_attention``: attention over packed ragged sequences without a cache (encoders,
cross-attention at prefill)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnexport.custom_ops import attention, checks
from attnexport.custom_ops.dispatch import select_backend
from attnexport.custom_ops.library import register
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.reference import attend
from attnexport.custom_ops.spec import OpSpec

SCHEMA = (
    "(Tensor query, Tensor key, Tensor value, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    f"{attention.OPTION_ARGS.format('False')}) -> Tensor"
)


class VarlenAttentionCall(NamedTuple):
    """The arguments of :func:`varlen_attention` (in its order, with its defaults), as a
    backend receives them. S sequences; query j of a sequence of q queries and k keys sits at
    position ``p = k - q + j`` (aligned to the end of the keys, "bottom-right")."""

    query: torch.Tensor
    """``[Tq, H, D]`` floating point."""
    key: torch.Tensor
    """``[Tk, Hkv, D]`` in the dtype of query; H must be a multiple of Hkv."""
    value: torch.Tensor
    """As key."""
    cu_seqlens_q: torch.Tensor
    """``[S + 1]`` int32 cumulative query counts; ``[-1] == Tq``."""
    cu_seqlens_k: torch.Tensor
    """``[S + 1]`` int32 cumulative key counts; ``[-1] == Tk``."""
    scale: float
    """As in :class:`~attnexport.custom_ops.paged_attention.PagedAttentionCall`, and so are
    the options below (with ``p`` as above)."""
    causal: bool = False
    alibi_slopes: torch.Tensor | None = None
    sliding_window: int = -1
    logits_soft_cap: float = 0.0


def check(call: VarlenAttentionCall) -> checks.BatchSummary | None:
    """Validates a varlen-attention call; returns the batch summary (None while tracing)."""
    query, key, value, cu_seqlens_q, cu_seqlens_k = call[:5]
    checks.expect_floating("query", query)
    checks.expect_rank("query", query, 3, "[num_query_tokens, num_heads, head_size]")
    checks.expect_ranks("[num_key_tokens, num_kv_heads, head_size]", key=key, value=value)
    checks.expect_ranks("[num_seqs + 1]", cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    checks.expect_like("dtype", "query", query, key=key, value=value)
    checks.expect_dtype("cu_seqlens_q", cu_seqlens_q, (checks.INDEX_DTYPE,))
    checks.expect_dtype("cu_seqlens_k", cu_seqlens_k, (checks.INDEX_DTYPE,))
    checks.expect_same_device(call._fields[:5], call[:5])
    checks.expect_like("shape", "key", key, value=value)
    checks.expect_head_size(query, key.shape[2], "key")
    checks.check_heads(query.shape[1], key.shape[1], "query", "key")
    checks.expect(
        cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0],
        lambda: (
            f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} (the shape of "
            f"cu_seqlens_q, num_seqs + 1), got {tuple(cu_seqlens_k.shape)}"
        ),
    )
    checks.expect(
        cu_seqlens_q.shape[0] >= 1,
        "cu_seqlens_q: expected at least one offset (num_seqs + 1 >= 1), got an empty tensor",
    )
    attention.check_options(call)
    if checks.is_fake(query, key, cu_seqlens_q, cu_seqlens_k):
        return None
    return memoised(
        "varlen",
        (cu_seqlens_q, cu_seqlens_k),
        (query.shape[0], key.shape[0]),
        lambda: _summarise(cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0]),
    )


def _summarise(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_queries: int, num_keys: int
) -> checks.BatchSummary:
    """The value checks of a varlen-attention call (shapes already checked); its summary."""
    query_lens = checks.check_offsets("cu_seqlens_q", cu_seqlens_q, num_queries, "num_query_tokens")
    key_lens = checks.check_offsets("cu_seqlens_k", cu_seqlens_k, num_keys, "num_key_tokens")
    num_seqs = query_lens.numel()
    max_query_len = int(query_lens.max()) if num_seqs else 0
    return checks.BatchSummary(
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=int(key_lens.max()) if num_seqs else 0,
        decode_only=max_query_len <= 1,
        has_context=bool(((query_lens > 1) & (key_lens > query_lens)).any()),
    )


def varlen_attention(*args) -> torch.Tensor:
    """Attention over packed ragged sequences without a cache (encoders, cross-attention at
    prefill).

    Takes the arguments of :class:`VarlenAttentionCall` (by position or name).

    Returns:
        ``[Tq, H, D]`` in the dtype of query; a query that sees no key gets zeros.
    """
    call = VarlenAttentionCall(*args)
    summary = check(call)
    if call.query.shape[0] == 0:
        return torch.empty_like(call.query)
    request = attention.describe("varlen_attention", call, call.key.shape[1], summary)
    return select_backend(request).varlen_attention(call)


def _fake(*args) -> torch.Tensor:
    check(VarlenAttentionCall(*args))
    return torch.empty_like(args[0])


def reference(*args, compute_dtype: torch.dtype = torch.float64, **kwargs) -> torch.Tensor:
    """Reference of ``attnexport::varlen_attention`` (the arguments of
    :class:`VarlenAttentionCall`); returns [Tq, H, D] in ``compute_dtype``, a sequence at a
    time (query j of a sequence with q queries and k keys at position k - q + j)."""
    call = VarlenAttentionCall(*args, **kwargs)
    query = call.query
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    q_starts, k_starts = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
    for i in range(len(q_starts) - 1):
        q0, q1, k0, k1 = q_starts[i], q_starts[i + 1], k_starts[i], k_starts[i + 1]
        num_queries, num_keys = q1 - q0, k1 - k0
        if num_queries == 0:
            continue
        positions = torch.arange(num_keys - num_queries, num_keys, device=query.device)
        out[q0:q1] = attend(
            query[q0:q1],
            call.key[k0:k1],
            call.value[k0:k1],
            positions,
            *attention.options(call),
            compute_dtype,
        )
    return out


SPEC = OpSpec(
    "varlen_attention",
    SCHEMA,
    varlen_attention,
    _fake,
    reference,
    backend_op=True,
    call_type=VarlenAttentionCall,
)
SPECS = (SPEC,)

varlen_attention = register(SPEC)
