"""The ``sdpa`` backend: pure PyTorch, every feature, any device torch runs on.

Keys and values stay token-major (``[B, L, Hkv, D]``, the cache's own layout): attention runs
one batched matmul per KV head on strided views (the query heads of a KV head are the rows of
one matrix), so no KV head is repeated and no transposing copy is made. Logits and softmax are
computed in fp32 (fp64 for fp64 inputs).

Decode sequences (one query token each) run in chunks whose gathered blocks stay cache-resident,
in workspace buffers reused across calls: with glibc malloc, fresh large temporaries page-fault
on every call, which made decode several times slower (docs/traps.md). What the step's
metadata fixes (which sequences decode, their blocks, the masks) is planned once per step (kept
in the executor's step plan, :mod:`attnexport.custom_ops.planning`) and reused by every layer.
Sequences with several query tokens run one at a time in query chunks that bound the logits'
memory.

``F.scaled_dot_product_attention(enable_gqa=True)`` is not used: on CPU it falls back to the
math path, much slower than a grouped matmul (docs/traps.md).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from attnexport.custom_ops import attention
from attnexport.custom_ops.attention import AttentionOptions
from attnexport.custom_ops.backend import AttentionBackend
from attnexport.custom_ops.dispatch import BackendCapabilities
from attnexport.custom_ops.kv_cache_dtype import CACHE_DTYPES, dequantize_rows, quantize_rows
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.reshape_and_cache import CacheWriteCall
from attnexport.custom_ops.varlen_attention import VarlenAttentionCall

# Logits of one query chunk are kept under this many bytes.
_LOGITS_BUDGET_BYTES = 64 * 2**20
# Gathered keys and values of one chunk of decode sequences are kept under this many bytes
# (unless one sequence alone needs more).
_DECODE_CHUNK_BYTES = 16 * 2**20


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits and softmax are computed in for inputs of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def write_cache(call: CacheWriteCall) -> None:
    """Scatters the call's key/value [T, Hkv, D] into caches of any strides and cache dtype
    (converted, or quantized with their scales for int8: :mod:`~attnexport.custom_ops.
    kv_cache_dtype`); negative slots are skipped."""
    key, value, key_cache, value_cache, slot_mapping = call[:5]
    slots = slot_mapping.to(torch.int64)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    block_size = key_cache.shape[1]
    index = (slots // block_size, slots % block_size)
    if call.key_scale_cache is None:
        key_cache.index_put_(index, key.to(key_cache.dtype))
        value_cache.index_put_(index, value.to(value_cache.dtype))
        return
    for rows, cache, scales in (
        (key, key_cache, call.key_scale_cache),
        (value, value_cache, call.value_scale_cache),
    ):
        q, scale = quantize_rows(rows)
        cache.index_put_(index, q)
        scales.index_put_(index, scale)


class _Workspace(threading.local):
    """Per-thread buffers reused across calls, grown on demand."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        # A buffer made under inference_mode (the engine's executor) cannot be written outside
        # it (a no_grad caller): such callers get buffers of their own.
        inference = torch.is_inference_mode_enabled()
        key = (name, dtype, torch.device(device), inference)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer[:numel].view(shape)


_workspace = _Workspace()


def gather_blocks(
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gathers the blocks ``block_ids`` [B, n] of a cache [NB, BS, Hkv, D] as token-major
    [B, n*BS, Hkv, D] in ``dtype``: whole blocks, memcpy speed. With ``out`` (a workspace
    buffer) no memory is allocated: a conversion goes through the thread's workspace. An
    int8 cache comes with its ``scale_cache`` [NB, BS, Hkv] and is dequantized (in float32,
    ``float(q) * scale``)."""
    num_seqs, blocks_per_seq = block_ids.shape
    block_size, num_kv_heads, head_size = cache.shape[1:]
    shape = (num_seqs, blocks_per_seq * block_size, num_kv_heads, head_size)
    ids = block_ids.reshape(-1)
    if scale_cache is not None:
        rows = dequantize_rows(cache.index_select(0, ids), scale_cache.index_select(0, ids))
        rows = rows.view(shape)
        return rows.to(dtype) if out is None else out.copy_(rows)
    if out is None:
        return cache.index_select(0, ids).view(shape).to(dtype)
    blocks = out.view(num_seqs * blocks_per_seq, *cache.shape[1:])
    if cache.dtype != dtype:  # gather in the cache dtype, then convert in one contiguous pass
        blocks = _workspace.get("blocks", blocks.shape, cache.dtype, cache.device)
    torch.index_select(cache, 0, ids, out=blocks)
    if blocks.dtype != dtype:
        out.view_as(blocks).copy_(blocks)
    return out


@dataclass(frozen=True)
class Masks:
    """What the metadata fixes about a padded batch's logits [B, Q, L] (shared by layers)."""

    invisible: torch.Tensor | None
    """[B, Q, L] bool, True where a key is masked out; None when every key is visible."""
    no_key: torch.Tensor | None
    """[B, Q] bool, queries that see no key at all (their output is zero); None if none."""
    distance: torch.Tensor | None
    """[B, Q, L] float32 key position minus query position, for ALiBi; None without ALiBi."""


def attention_masks(
    query_positions: torch.Tensor,
    key_lens: torch.Tensor,
    num_keys: int,
    causal: bool,
    sliding_window: int,
    alibi: bool,
    key_offset: int = 0,
) -> Masks:
    """The masks of a padded batch: query_positions [B, Q] and key_lens [B] int64 absolute;
    key index l sits at position ``key_offset + l`` and is padding from ``key_lens[b]`` on."""
    key_positions = torch.arange(key_offset, key_offset + num_keys, device=key_lens.device)
    visible = key_positions[None, None, :] < key_lens[:, None, None]
    if causal:
        visible = visible & (key_positions[None, None, :] <= query_positions[:, :, None])
    if sliding_window >= 0:
        visible = visible & (
            (query_positions[:, :, None] - key_positions[None, None, :]) < sliding_window
        )
    visible = visible.expand(*query_positions.shape, num_keys)
    has_key = visible.any(dim=-1)
    distance = None
    if alibi:
        distance = (key_positions[None, None, :] - query_positions[:, :, None]).to(torch.float32)
    return Masks(
        invisible=None if bool(visible.all()) else ~visible,
        no_key=None if bool(has_key.all()) else ~has_key,
        distance=distance,
    )


def grouped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    masks: Masks,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    logits_soft_cap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention of a padded batch, computed in the dtype of ``key``; ``sinks`` [H]: a
    logit per head in each softmax (of a key whose value is zero).

    Args:
        query: ``[B, Q, H, D]``.
        key, value: ``[B, L, Hkv, D]``, any strides with D contiguous.
        masks: from :func:`attention_masks` (with ``alibi`` when alibi_slopes is given).

    Returns:
        ``[B, Q, H, D]`` in the dtype of ``key``; queries that see no key get zeros.
    """
    num_seqs, num_queries, num_heads, head_size = query.shape
    num_keys, num_kv_heads = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    work_dtype = key.dtype

    # Rows are (query head within the group, query token): one matrix per (KV head, sequence),
    # multiplied with that KV head's keys in place (a strided view, no copy).
    q = (query.to(work_dtype) * scale).view(num_seqs, num_queries, num_kv_heads, group, head_size)
    rows = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_seqs, group * num_queries, head_size)
    logits = torch.empty(
        (num_kv_heads, num_seqs, group * num_queries, num_keys),
        dtype=work_dtype,
        device=query.device,
    )
    for head in range(num_kv_heads):
        torch.bmm(rows[head], key[:, :, head].transpose(1, 2), out=logits[head])
    logits5 = logits.view(num_kv_heads, num_seqs, group, num_queries, num_keys)

    if logits_soft_cap > 0:
        logits.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(torch.float32).view(num_kv_heads, 1, group, 1, 1)
        logits5.add_((slopes * masks.distance[None, :, None]).to(work_dtype))
    if masks.invisible is not None:
        logits5.masked_fill_(masks.invisible[None, :, None], float("-inf"))
    if sinks is None:
        weights = torch.softmax(logits, dim=-1)
    else:  # the sink's column joins the softmax, then is dropped
        sink = sinks.to(work_dtype).view(num_kv_heads, 1, group, 1, 1)
        sink = sink.expand(num_kv_heads, num_seqs, group, num_queries, 1)
        weights = torch.softmax(torch.cat([logits5, sink], dim=-1), dim=-1)[..., :num_keys]
        weights = weights.reshape(logits.shape)
    if masks.no_key is not None:
        weights.view_as(logits5).masked_fill_(masks.no_key[None, :, None, :, None], 0.0)
    out = torch.empty(rows.shape, dtype=work_dtype, device=query.device)  # [Hkv, B, G*Q, D]
    for head in range(num_kv_heads):
        torch.bmm(weights[head], value[:, :, head], out=out[head])
    out = out.view(num_kv_heads, num_seqs, group, num_queries, head_size)
    return out.permute(1, 3, 0, 2, 4).reshape(num_seqs, num_queries, num_heads, head_size)


def _query_chunk(num_heads: int, num_keys: int, element_size: int) -> int:
    return max(1, _LOGITS_BUDGET_BYTES // max(1, num_heads * num_keys * element_size))


@dataclass(frozen=True)
class _DecodeChunk:
    """Decode sequences ``start:stop`` (in decode order) attended together."""

    start: int
    stop: int
    tokens: torch.Tensor | None
    """[b] int64 query tokens; None when they are ``start:stop`` (a decode-only batch)."""
    block_ids: torch.Tensor
    """[b, n] int64 blocks to gather (padding entries clamped to a valid block)."""
    masks: Masks
    stale: torch.Tensor | None
    """int64 rows of the gathered [b * n * BS] slots past each sequence's length (None if
    none): their values are zeroed after the gather, since a masked weight of 0 times a stale
    NaN or Inf value is NaN."""


@dataclass(frozen=True)
class _Prefill:
    """A sequence with several query tokens, attended on its own."""

    start: int
    stop: int
    seq_len: int
    block_ids: torch.Tensor
    """[1, n] int64."""


@dataclass(frozen=True)
class _PagedPlan:
    decode: tuple[_DecodeChunk, ...]
    prefills: tuple[_Prefill, ...]


def _plan_step(call: PagedAttentionCall, work_dtype: torch.dtype) -> _PagedPlan:
    """Host-side work of a paged-attention step, kept in the step plan for its other layers."""
    extra = (
        call.query.shape[0],
        tuple(call.key_cache.shape),
        work_dtype,
        call.causal,
        call.sliding_window,
        call.alibi_slopes is not None,
    )
    return memoised(
        "sdpa-paged",
        (call.block_tables, call.seq_lens, call.query_start_loc),
        extra,
        lambda: _build_step_plan(call, work_dtype),
    )


def _build_step_plan(call: PagedAttentionCall, work_dtype: torch.dtype) -> _PagedPlan:
    block_tables, seq_lens, query_start_loc = call.block_tables, call.seq_lens, call.query_start_loc
    causal, sliding_window, alibi = call.causal, call.sliding_window, call.alibi_slopes is not None
    num_tokens = call.query.shape[0]
    num_blocks, block_size, num_kv_heads, head_size = call.key_cache.shape
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    query_lens = [end - start for start, end in itertools.pairwise(starts)]
    # A decode over no key (non-causal over an empty cache) is zeros: nothing to gather (its
    # block-table row may have no column at all).
    decodes = [i for i, n in enumerate(query_lens) if n == 1 and lens[i] > 0]
    decode_only = len(decodes) == num_tokens

    chunks = []
    seq_bytes = 2 * max([1, *(lens[i] for i in decodes)]) * num_kv_heads * head_size
    per_chunk = max(1, _DECODE_CHUNK_BYTES // (seq_bytes * work_dtype.itemsize))
    for first in range(0, len(decodes), per_chunk):
        rows = decodes[first : first + per_chunk]
        chunk_lens = torch.tensor([lens[i] for i in rows], device=seq_lens.device)
        width = max(1, -(-int(chunk_lens.max()) // block_size))
        row_ids = torch.tensor(rows, device=block_tables.device)
        block_ids = block_tables.index_select(0, row_ids)[:, :width].to(torch.int64)
        masks = attention_masks(
            (chunk_lens - 1)[:, None], chunk_lens, width * block_size, causal, sliding_window, alibi
        )
        tokens = torch.tensor([starts[i] for i in rows], device=query_start_loc.device)
        key_positions = torch.arange(width * block_size, device=chunk_lens.device)
        stale = (key_positions[None, :] >= chunk_lens[:, None]).view(-1).nonzero().view(-1)
        chunks.append(
            _DecodeChunk(
                start=first,
                stop=first + len(rows),
                tokens=None if decode_only else tokens,
                block_ids=block_ids.clamp_(0, num_blocks - 1),  # padding entries
                masks=masks,
                stale=stale if stale.numel() else None,
            )
        )
    prefills = [
        _Prefill(
            starts[i],
            starts[i + 1],
            lens[i],
            block_tables[i : i + 1, : -(-lens[i] // block_size)].to(torch.int64),
        )
        for i, n in enumerate(query_lens)
        if n > 1 and lens[i] > 0  # non-causal over an empty sequence: zeros
    ]
    return _PagedPlan(tuple(chunks), tuple(prefills))


class SdpaBackend(AttentionBackend):
    """Pure-PyTorch kernels; the fallback that can run every call."""

    name = "sdpa"
    priority = 0
    capabilities = BackendCapabilities(
        ops=frozenset({"reshape_and_cache", "paged_attention", "varlen_attention"}),
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64}),
        cache_dtypes=frozenset(CACHE_DTYPES),
        sinks=True,
        notes=(
            "reference-quality pure PyTorch; fp32 logits for half-precision inputs",
            "KV caches of any cache dtype (float32, float16, bfloat16, int8 with scales)",
        ),
    )

    def reshape_and_cache(self, call: CacheWriteCall) -> None:
        write_cache(call)

    def paged_attention(self, call: PagedAttentionCall) -> torch.Tensor:
        query, key_cache, value_cache = call.query, call.key_cache, call.value_cache
        work_dtype = compute_dtype(query.dtype)
        plan = _plan_step(call, work_dtype)
        out = torch.zeros_like(query)
        for chunk in plan.decode:
            shape = (*chunk.block_ids.shape, *key_cache.shape[1:])
            shape = (shape[0], shape[1] * shape[2], *shape[3:])  # [b, n * BS, Hkv, D]
            key, value = (
                gather_blocks(
                    cache,
                    chunk.block_ids,
                    work_dtype,
                    _workspace.get(name, shape, work_dtype, query.device),
                    scale_cache,
                )
                for name, cache, scale_cache in (
                    ("key", key_cache, call.key_scale_cache),
                    ("value", value_cache, call.value_scale_cache),
                )
            )
            if chunk.stale is not None:  # keys need nothing: their logits are masked to -inf
                value.view(-1, *shape[2:]).index_fill_(0, chunk.stale, 0.0)
            q = query[chunk.start : chunk.stop] if chunk.tokens is None else query[chunk.tokens]
            result = grouped_attention(
                q.unsqueeze(1),
                key,
                value,
                chunk.masks,
                call.scale,
                call.alibi_slopes,
                call.logits_soft_cap,
                call.sinks,
            )
            if chunk.tokens is None:
                out[chunk.start : chunk.stop] = result[:, 0]
            else:
                out.index_copy_(0, chunk.tokens, result[:, 0].to(query.dtype))

        for prefill in plan.prefills:
            self._attend_sequence(
                call,
                query[prefill.start : prefill.stop],
                gather_blocks(
                    key_cache, prefill.block_ids, work_dtype, scale_cache=call.key_scale_cache
                ),
                gather_blocks(
                    value_cache, prefill.block_ids, work_dtype, scale_cache=call.value_scale_cache
                ),
                prefill.seq_len,
                out[prefill.start : prefill.stop],
            )
        return out

    def varlen_attention(self, call: VarlenAttentionCall) -> torch.Tensor:
        query = call.query
        work_dtype = compute_dtype(query.dtype)
        q_starts, k_starts = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        out = torch.zeros_like(query)
        for i in range(len(q_starts) - 1):
            q0, q1, k0, k1 = q_starts[i], q_starts[i + 1], k_starts[i], k_starts[i + 1]
            if q1 == q0 or k1 == k0:
                continue
            k = call.key[k0:k1].to(work_dtype).unsqueeze(0)  # [1, L, Hkv, D]
            v = call.value[k0:k1].to(work_dtype).unsqueeze(0)
            self._attend_sequence(call, query[q0:q1], k, v, k1 - k0, out[q0:q1])
        return out

    @staticmethod
    def _attend_sequence(
        options: AttentionOptions,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_keys: int,
        out: torch.Tensor,
    ) -> None:
        """One sequence: query [q, H, D] (the last q positions) over key/value [1, L, Hkv, D]
        (L >= num_keys valid keys), with the logits options of ``options`` (the op's call);
        writes ``out`` [q, H, D] in query chunks."""
        scale, causal, alibi_slopes, sliding_window, logits_soft_cap = attention.options(options)
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
            masks = attention_masks(
                positions,
                key_lens,
                key_end - key_start,
                causal,
                sliding_window,
                alibi_slopes is not None,
                key_offset=key_start,
            )
            result = grouped_attention(
                query[start:stop].unsqueeze(0),
                key[:, key_start:key_end],
                value[:, key_start:key_end],
                masks,
                scale,
                alibi_slopes,
                logits_soft_cap,
                getattr(options, "sinks", None),
            )
            out[start:stop] = result[0]
