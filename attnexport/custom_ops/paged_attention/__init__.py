"""``paged_attention``: attention of packed ragged queries over a paged KV cache."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnexport.custom_ops import attention, checks
from attnexport.custom_ops.dispatch import select_backend
from attnexport.custom_ops.kv_cache_dtype import from_cache
from attnexport.custom_ops.library import register
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.reference import attend
from attnexport.custom_ops.spec import OpSpec

SCHEMA = (
    "(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    f"Tensor seq_lens, Tensor query_start_loc, {attention.OPTION_ARGS.format('True')}, "
    "Tensor? key_scale_cache=None, Tensor? value_scale_cache=None, Tensor? sinks=None) -> Tensor"
)


class PagedAttentionCall(NamedTuple):
    """The arguments of :func:`paged_attention` (in its order, with its defaults), as a backend
    receives them. S sequences, T query tokens."""

    query: torch.Tensor
    """``[T, H, D]`` floating point."""
    key_cache: torch.Tensor
    """``[num_blocks, block_size, Hkv, D]``, the cache dtype (floating point or int8, may
    differ from query's); H must be a multiple of Hkv (grouped-query attention)."""
    value_cache: torch.Tensor
    """As key_cache."""
    block_tables: torch.Tensor
    """``[S, max_blocks_per_seq]`` int32, the blocks of each sequence in order."""
    seq_lens: torch.Tensor
    """``[S]`` int32, the KV length of each sequence (cached + new, already written)."""
    query_start_loc: torch.Tensor
    """``[S + 1]`` int32 cumulative query counts; ``[-1] == T``."""
    scale: float
    """Multiplies ``q . k``."""
    causal: bool = True
    """Query j of sequence i sits at ``p = seq_lens[i] - q_i + j`` and sees keys ``k <= p``;
    False lets every query see all ``seq_lens[i]`` keys."""
    alibi_slopes: torch.Tensor | None = None
    """Optional ``[H]`` float; adds ``slope[h] * (k - p)`` (in fp32)."""
    sliding_window: int = -1
    """If >= 0, key k is visible only when ``p - k < sliding_window``."""
    logits_soft_cap: float = 0.0
    """If > 0, logits become ``cap * tanh(logits / cap)`` before ALiBi."""
    key_scale_cache: torch.Tensor | None = None
    """int8 caches only: float32 ``[num_blocks, block_size, Hkv]``, the scale of each key row
    (it reads back as ``float(q) * scale``)."""
    value_scale_cache: torch.Tensor | None = None
    """As key_scale_cache, for value_cache."""
    sinks: torch.Tensor | None = None
    """Optional ``[H]`` float: attention sinks (GPT-OSS), a logit per head that joins each
    row's softmax as a key of zero value: the weights become ``exp(s_k) / (exp(sink[h]) +
    sum_k' exp(s_k'))``, and a query that sees no key still gets zeros."""


def check(call: PagedAttentionCall) -> checks.BatchSummary | None:
    """Validates a paged-attention call; returns the batch summary (None while tracing)."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = call[:6]
    checks.expect_floating("query", query)
    checks.expect_rank("query", query, 3, "[num_tokens, num_heads, head_size]")
    checks.expect_ranks(checks.CACHE_DIMS, key_cache=key_cache, value_cache=value_cache)
    checks.expect_rank("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    checks.expect_rank("seq_lens", seq_lens, 1, "[num_seqs]")
    checks.expect_rank("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    checks.check_cache_dtype(
        "query", query, key_cache, value_cache, call.key_scale_cache, call.value_scale_cache
    )
    for name, tensor in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        checks.expect_dtype(name, tensor, (checks.INDEX_DTYPE,))
    checks.expect_same_device(call._fields[:6], call[:6])
    checks.expect_like("shape", "key_cache", key_cache, value_cache=value_cache)
    checks.expect_head_size(query, key_cache.shape[3], "key_cache")
    checks.check_heads(query.shape[1], key_cache.shape[2], "query", "key_cache")
    num_seqs = seq_lens.shape[0]
    checks.expect(
        block_tables.shape[0] == num_seqs,
        lambda: (
            f"block_tables: expected {num_seqs} rows (one per sequence in seq_lens), "
            f"got shape {tuple(block_tables.shape)}"
        ),
    )
    checks.expect(
        query_start_loc.shape[0] == num_seqs + 1,
        lambda: (
            f"query_start_loc: expected shape [{num_seqs} + 1] (num_seqs + 1), "
            f"got {tuple(query_start_loc.shape)}"
        ),
    )
    attention.check_options(call)
    attention.check_per_head("sinks", call.sinks, query)
    if checks.is_fake(query, key_cache, block_tables, seq_lens, query_start_loc):
        return None

    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    return memoised(
        "paged",
        (block_tables, seq_lens, query_start_loc),
        (num_blocks, block_size, query.shape[0], bool(call.causal)),
        lambda: _summarise(call, num_blocks, block_size),
    )


def _summarise(call: PagedAttentionCall, num_blocks: int, block_size: int) -> checks.BatchSummary:
    """The value checks of a paged-attention call (shapes already checked); its summary."""
    block_tables, seq_lens = call.block_tables, call.seq_lens
    num_seqs = seq_lens.shape[0]
    query_lens = checks.check_offsets(
        "query_start_loc", call.query_start_loc, call.query.shape[0], "num_tokens"
    )
    if num_seqs == 0:
        return checks.BatchSummary(0, 0, 0, True, False)
    if int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens: expected non-negative lengths, got {seq_lens.tolist()}")
    lens = seq_lens.to(torch.int64)  # int64 below: block counts of lengths near 2^31 wrap
    if call.causal:
        short = (lens < query_lens).nonzero()
        if short.numel():
            i = int(short[0, 0])
            raise ValueError(
                f"seq_lens: sequence {i} has {int(query_lens[i])} query tokens but "
                f"seq_lens[{i}] = {int(seq_lens[i])}; with causal=True expected seq_lens >= the "
                f"query count (seq_lens counts cached context plus the new tokens)"
            )
    max_seq_len = int(lens.max())
    capacity = block_tables.shape[1] * block_size
    if max_seq_len > capacity:
        i = int(lens.argmax())
        raise ValueError(
            f"seq_lens: seq_lens[{i}] = {max_seq_len} exceeds what block_tables covers; "
            f"expected <= max_blocks_per_seq * block_size = {block_tables.shape[1]} * "
            f"{block_size} = {capacity}"
        )
    blocks_used = (lens + (block_size - 1)) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device) < blocks_used[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_tables: block_tables[{i}, {j}] = {int(block_tables[i, j])} is out of range; "
            f"expected a block id in [0, {num_blocks}) (num_blocks of key_cache)"
        )
    max_query_len = int(query_lens.max())
    multi = query_lens > 1
    return checks.BatchSummary(
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        decode_only=max_query_len <= 1,
        has_context=bool((multi & (lens > query_lens)).any()),
    )


def paged_attention(*args) -> torch.Tensor:
    """Attention of packed ragged queries over a paged KV cache (prefill, decode, chunked
    prefill, mixed batches, and non-causal cross-attention).

    Takes the arguments of :class:`PagedAttentionCall` (by position or name).

    Returns:
        ``[T, H, D]`` in the dtype of query; a query that sees no key gets zeros.
    """
    call = PagedAttentionCall(*args)
    summary = check(call)
    query, key_cache = call.query, call.key_cache
    if query.shape[0] == 0:
        return torch.empty_like(query)
    request = attention.describe(
        "paged_attention",
        call,
        key_cache.shape[2],
        summary,
        block_size=key_cache.shape[1],
        cache_contiguous=key_cache.is_contiguous(),
        cache_dtype=key_cache.dtype,
    )
    return select_backend(request).paged_attention(call)


def _fake(*args) -> torch.Tensor:
    check(PagedAttentionCall(*args))
    return torch.empty_like(args[0])


def gather_sequence(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence from a paged cache [NB, BS, ...], as
    [seq_len, ...] (a cache [.., Hkv, D] or a scale cache [..., Hkv])."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len)
    blocks = block_table_row.cpu().long()[positions // block_size]
    return cache[blocks.to(cache.device), (positions % block_size).to(cache.device)]


def _gather_rows(call: PagedAttentionCall, index: int, cache, scales, compute_dtype):
    """Sequence ``index``'s keys or values widened to ``compute_dtype`` (int8: dequantized
    in float32 first, as docs/ops.md states)."""
    row, seq_len = call.block_tables[index], int(call.seq_lens[index])
    scale = None if scales is None else gather_sequence(scales, row, seq_len)
    return from_cache(gather_sequence(cache, row, seq_len), scale, compute_dtype)


def reference(*args, compute_dtype: torch.dtype = torch.float64, **kwargs) -> torch.Tensor:
    """Reference of ``attnexport::paged_attention`` (the arguments of
    :class:`PagedAttentionCall`); returns [T, H, D] in ``compute_dtype``, a sequence at a time."""
    call = PagedAttentionCall(*args, **kwargs)
    query = call.query
    out = torch.zeros(query.shape, dtype=compute_dtype, device=query.device)
    starts = call.query_start_loc.tolist()
    for i, seq_len in enumerate(call.seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        num_queries = end - start
        if num_queries == 0:
            continue
        key = _gather_rows(call, i, call.key_cache, call.key_scale_cache, compute_dtype)
        value = _gather_rows(call, i, call.value_cache, call.value_scale_cache, compute_dtype)
        # The queries are the last num_queries positions of the sequence.
        positions = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        out[start:end] = attend(
            query[start:end],
            key,
            value,
            positions,
            *attention.options(call),
            compute_dtype,
            sinks=call.sinks,
        )
    return out


SPEC = OpSpec(
    "paged_attention",
    SCHEMA,
    paged_attention,
    _fake,
    reference,
    cache_arguments=("key_cache", "value_cache"),
    backend_op=True,
    call_type=PagedAttentionCall,
)
SPECS = (SPEC,)

paged_attention = register(SPEC)
