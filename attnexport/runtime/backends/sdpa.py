"""The ``sdpa`` backend: pure PyTorch, every feature, any device torch runs on.

Decode sequences (one query token each) are batched: their KV blocks are gathered into one
``[Hkv, B, L, D]`` tensor and attended with grouped matmuls (query heads of one KV head share
its keys), so temporaries are O(batch KV) and no KV head is repeated. Sequences with several
query tokens run one at a time in query chunks that bound the logits' memory. Logits and
softmax are computed in fp32 (fp64 for fp64 inputs).

``F.scaled_dot_product_attention(enable_gqa=True)`` is not used: on CPU it falls back to the
math path, 10-40x slower than a grouped matmul (DESIGN.md section 4).
"""

from __future__ import annotations

import itertools

import torch

from attnexport.custom_ops.dispatch import AttentionBackend, BackendCapabilities

# Logits of one query chunk are kept under this many bytes.
_LOGITS_BUDGET_BYTES = 64 * 2**20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits and softmax are computed in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters key/value [T, Hkv, D] into caches of any strides; negative slots are skipped."""
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache.index_put_((blocks, offsets), key)
    value_cache.index_put_((blocks, offsets), value)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gathers the blocks ``block_ids`` [B, n] of a cache [NB, BS, Hkv, D] as [Hkv, B, n*BS, D].

    One copy: the head-major output layout lets every batch of the grouped matmuls be a plain
    matrix, so matmul does not copy again.
    """
    num_seqs, blocks_per_seq = block_ids.shape
    block_size, num_kv_heads, head_size = cache.shape[1:]
    by_head = cache.permute(2, 0, 1, 3)  # [Hkv, NB, BS, D] view
    gathered = by_head.index_select(1, block_ids.reshape(-1))
    return gathered.view(num_kv_heads, num_seqs, blocks_per_seq * block_size, head_size)


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
    key_offset: int = 0,
) -> torch.Tensor:
    """Masked attention of a padded batch, computed in the dtype of ``key``.

    Args:
        query: ``[B, Q, H, D]``.
        key, value: ``[Hkv, B, L, D]``; key index l has absolute position ``key_offset + l``.
        query_positions: ``[B, Q]`` int64 absolute positions of the queries.
        key_lens: ``[B]`` int64; keys at absolute positions >= key_lens[b] are padding.

    Returns:
        ``[B, Q, H, D]`` in the dtype of ``key``; queries that see no key get zeros.
    """
    num_seqs, num_queries, num_heads, head_size = query.shape
    num_kv_heads, _, num_keys, _ = key.shape
    group = num_heads // num_kv_heads
    work_dtype = key.dtype

    # Rows are (query head within the group, query token), so one KV head's batch is a matrix.
    q = (query.to(work_dtype) * scale).view(num_seqs, num_queries, num_kv_heads, group, head_size)
    q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_seqs, group * num_queries, head_size)
    logits = torch.matmul(q, key.transpose(-1, -2))  # [Hkv, B, G*Q, L]
    logits5 = logits.view(num_kv_heads, num_seqs, group, num_queries, num_keys)

    if logits_soft_cap > 0:
        logits.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    key_positions = torch.arange(key_offset, key_offset + num_keys, device=key.device)
    if alibi_slopes is not None:
        distance = (key_positions[None, None, :] - query_positions[:, :, None]).to(torch.float32)
        slopes = alibi_slopes.to(torch.float32).view(num_kv_heads, 1, group, 1, 1)
        logits5.add_((slopes * distance[None, :, None]).to(work_dtype))

    visible = (key_positions[None, None, :] < key_lens[:, None, None]).expand(
        num_seqs, num_queries, num_keys
    )
    if causal:
        visible = visible & (key_positions[None, None, :] <= query_positions[:, :, None])
    if sliding_window >= 0:
        visible = visible & (
            (query_positions[:, :, None] - key_positions[None, None, :]) < sliding_window
        )
    logits5.masked_fill_(~visible[None, :, None], float("-inf"))
    weights = torch.softmax(logits, dim=-1)
    has_key = visible.any(dim=-1)
    if not bool(has_key.all()):
        weights.view_as(logits5).masked_fill_(~has_key[None, :, None, :, None], 0.0)
    out = torch.matmul(weights, value)  # [Hkv, B, G*Q, D]
    out = out.view(num_kv_heads, num_seqs, group, num_queries, head_size)
    return out.permute(1, 3, 0, 2, 4).reshape(num_seqs, num_queries, num_heads, head_size)


def _query_chunk(num_heads: int, num_keys: int, element_size: int) -> int:
    return max(1, _LOGITS_BUDGET_BYTES // max(1, num_heads * num_keys * element_size))


class SdpaBackend(AttentionBackend):
    """Pure-PyTorch kernels; the fallback that can run every call."""

    name = "sdpa"
    priority = 0
    capabilities = BackendCapabilities(
        ops=frozenset({"reshape_and_cache", "paged_attention", "varlen_attention"}),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
        notes=("reference-quality pure PyTorch; fp32 logits for half-precision inputs",),
    )

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping) -> None:
        write_cache(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(
        self,
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
    ) -> torch.Tensor:
        work_dtype = compute_dtype(query.dtype)
        num_blocks, block_size = key_cache.shape[:2]
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        query_lens = [end - start for start, end in itertools.pairwise(starts)]
        out = torch.zeros_like(query)
        options = (scale, causal, alibi_slopes, sliding_window, logits_soft_cap)

        decodes = [i for i, n in enumerate(query_lens) if n == 1]
        if decodes:
            rows = torch.tensor(decodes, device=query.device)
            dec_lens = seq_lens.index_select(0, rows).to(torch.int64)
            blocks_needed = max(1, -(-max(lens[i] for i in decodes) // block_size))
            block_ids = block_tables.index_select(0, rows)[:, :blocks_needed]
            block_ids = block_ids.to(torch.int64).clamp_(0, num_blocks - 1)  # padding entries
            key = gather_blocks(key_cache, block_ids).to(work_dtype)
            value = gather_blocks(value_cache, block_ids).to(work_dtype)
            tokens = query_start_loc.index_select(0, rows).to(torch.int64)
            all_tokens = len(decodes) == query.shape[0]
            q = (query if all_tokens else query.index_select(0, tokens)).unsqueeze(1)
            result = grouped_attention(q, key, value, (dec_lens - 1)[:, None], dec_lens, *options)
            if all_tokens:
                out.copy_(result[:, 0])
            else:
                out.index_copy_(0, tokens, result[:, 0].to(query.dtype))

        for i, num_queries in enumerate(query_lens):
            if num_queries <= 1:
                continue
            seq_len = lens[i]
            if seq_len == 0:
                continue  # non-causal over an empty sequence: zeros
            blocks_needed = -(-seq_len // block_size)
            block_ids = block_tables[i : i + 1, :blocks_needed].to(torch.int64)
            key = gather_blocks(key_cache, block_ids).to(work_dtype)
            value = gather_blocks(value_cache, block_ids).to(work_dtype)
            self._attend_sequence(
                query[starts[i] : starts[i + 1]],
                key,
                value,
                seq_len,
                out[starts[i] : starts[i + 1]],
                *options,
            )
        return out

    def varlen_attention(
        self,
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
    ) -> torch.Tensor:
        work_dtype = compute_dtype(query.dtype)
        q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.zeros_like(query)
        for i in range(len(q_starts) - 1):
            q0, q1, k0, k1 = q_starts[i], q_starts[i + 1], k_starts[i], k_starts[i + 1]
            if q1 == q0 or k1 == k0:
                continue
            k = key[k0:k1].to(work_dtype).permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, L, D]
            v = value[k0:k1].to(work_dtype).permute(1, 0, 2).unsqueeze(1)
            self._attend_sequence(
                query[q0:q1],
                k,
                v,
                k1 - k0,
                out[q0:q1],
                scale,
                causal,
                alibi_slopes,
                sliding_window,
                logits_soft_cap,
            )
        return out

    @staticmethod
    def _attend_sequence(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_keys: int,
        out: torch.Tensor,
        scale: float,
        causal: bool,
        alibi_slopes: torch.Tensor | None,
        sliding_window: int,
        logits_soft_cap: float,
    ) -> None:
        """One sequence: query [q, H, D] (the last q positions) over key/value [Hkv, 1, L, D]
        (L >= num_keys valid keys); writes ``out`` [q, H, D] in query chunks."""
        num_queries, num_heads, _ = query.shape
        chunk = _query_chunk(num_heads, num_keys, key.element_size())
        first_position = num_keys - num_queries
        key_lens = torch.tensor([num_keys], device=query.device)
        for start in range(0, num_queries, chunk):
            stop = min(start + chunk, num_queries)
            low_pos, high_pos = first_position + start, first_position + stop - 1
            # Only keys some query of the chunk can see take part.
            key_end = min(num_keys, high_pos + 1) if causal else num_keys
            key_start = max(0, low_pos - sliding_window + 1) if sliding_window >= 0 else 0
            if causal or sliding_window >= 0:
                key_start = min(max(0, key_start), key_end)
            positions = torch.arange(low_pos, high_pos + 1, device=query.device)[None, :]
            if key_end <= key_start:
                out[start:stop] = 0
                continue
            result = grouped_attention(
                query[start:stop].unsqueeze(0),
                key[:, :, key_start:key_end],
                value[:, :, key_start:key_end],
                positions,
                key_lens,
                scale,
                causal,
                alibi_slopes,
                sliding_window,
                logits_soft_cap,
                key_offset=key_start,
            )
            out[start:stop] = result[0]
