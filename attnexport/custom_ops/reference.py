"""The reference semantics of the attnexport ops, written for clarity, not speed.

Each function follows docs/ops.md line by line, one sequence at a time, and computes in
``compute_dtype`` (float64 by default). Tests compare every backend with these; they are also
the executable definition of the masking rules.
"""

from __future__ import annotations

import functools

import torch


def visible_keys(
    query_positions: torch.Tensor, num_keys: int, causal: bool, sliding_window: int
) -> torch.Tensor:
    """Mask [q, num_keys]: key k is visible to the query at absolute position p iff
    (not causal or k <= p) and (sliding_window < 0 or p - k < sliding_window)."""
    k = torch.arange(num_keys, device=query_positions.device)[None, :]
    p = query_positions[:, None]
    visible = torch.ones(len(query_positions), num_keys, dtype=torch.bool, device=k.device)
    if causal:
        visible &= k <= p
    if sliding_window >= 0:
        visible &= (p - k) < sliding_window
    return visible


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Attention of one sequence: query [q, H, D] over key/value [L, Hkv, D].

    Returns [q, H, D] in ``compute_dtype``. A query that sees no key gets zeros.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    q = query.to(compute_dtype)
    k = key.to(compute_dtype).repeat_interleave(group, dim=1)  # KV head h // group serves head h
    v = value.to(compute_dtype).repeat_interleave(group, dim=1)

    logits = scale * torch.einsum("qhd,khd->hqk", q, k)
    if logits_soft_cap > 0:
        logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
    if alibi_slopes is not None:
        distance = (
            torch.arange(key.shape[0], device=q.device)[None, :] - query_positions[:, None]
        ).to(compute_dtype)
        logits = logits + alibi_slopes.to(compute_dtype)[:, None, None] * distance[None]

    visible = visible_keys(query_positions, key.shape[0], causal, sliding_window)
    logits = logits.masked_fill(~visible[None], float("-inf"))
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    return torch.einsum("hqk,khd->qhd", weights, v)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes token t of key/value [T, Hkv, D] at slot ``slot_mapping[t]``; negative skips."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def gather_sequence(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence from a paged cache, as [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    blocks = block_table_row.cpu().long()[positions // block_size]
    return cache[blocks.to(cache.device), (positions % block_size).to(cache.device)]


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
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of ``attnexport::paged_attention``; returns [T, H, D] in ``compute_dtype``."""
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        key = gather_sequence(key_cache, block_tables[i], seq_len)
        value = gather_sequence(value_cache, block_tables[i], seq_len)
        # The queries are the last num_queries positions of the sequence.
        positions = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        out[start:end] = attend(
            query[start:end],
            key,
            value,
            positions,
            scale,
            causal,
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            compute_dtype,
        )
    return out


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
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of ``attnexport::varlen_attention``; returns [Tq, H, D] in ``compute_dtype``.

    Query j of a sequence with q queries and k keys sits at position k - q + j (bottom-right).
    """
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(q_starts) - 1):
        q0, q1, k0, k1 = q_starts[i], q_starts[i + 1], k_starts[i], k_starts[i + 1]
        num_queries, num_keys = q1 - q0, k1 - k0
        if num_queries == 0:
            continue
        positions = torch.arange(num_keys - num_queries, num_keys, device=query.device)
        out[q0:q1] = attend(
            query[q0:q1],
            key[k0:k1],
            value[k0:k1],
            positions,
            scale,
            causal,
            alibi_slopes,
            sliding_window,
            logits_soft_cap,
            compute_dtype,
        )
    return out


def rotary_embedding(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of ``attnexport::rotary_embedding``; returns [T, H, D] in ``compute_dtype``.

    With halves ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]``, element i of a head becomes
    ``x[i] * cos[i] - x2[i] * sin[i]`` in the first half and ``x[i] * cos[i] + x1[i - D/2] *
    sin[i]`` in the second.
    """
    x, cos, sin = (t.to(compute_dtype) for t in (x, cos, sin))
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    first = x1 * cos[..., :half] - x2 * sin[..., :half]
    second = x2 * cos[..., half:] + x1 * sin[..., half:]
    return torch.cat((first, second), dim=-1)


def qkv_rotary_embedding(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``attnexport::qkv_rotary_embedding``: the heads of qkv ``[T, H + 2 Hkv,
    D]`` split into query, key, value, the first two rotated by :func:`rotary_embedding`."""
    heads = qkv.unflatten(1, (num_heads + 2 * num_kv_heads, cos.shape[1]))
    query, key, value = heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)
    rotate = functools.partial(rotary_embedding, cos=cos, sin=sin, compute_dtype=compute_dtype)
    return rotate(query), rotate(key), value.to(compute_dtype)


def silu_and_mul(x: torch.Tensor, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Reference of ``attnexport::silu_and_mul``: ``g / (1 + exp(-g)) * u`` for the halves
    ``g, u`` of x, in ``compute_dtype``."""
    x = x.to(compute_dtype)
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    return gate / (1 + torch.exp(-gate)) * up


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``attnexport::fused_add_rms_norm``: ``(normed, total)`` in ``compute_dtype``
    (the sum is not rounded to the input dtype)."""
    total = x.to(compute_dtype) + residual.to(compute_dtype)
    rms = torch.sqrt((total * total).mean(-1, keepdim=True) + epsilon)
    return weight.to(compute_dtype) * (total / rms), total
