"""Host-side plans for the IPEX backend, built once per step and reused by every layer.

A plan turns the step's validated metadata into what IPEX's two attention kernels take:

* the single-query kernel (``single_query_cached_kv_attention``) gets one *row* per query token
  it computes. A decode token is a row over its sequence's keys. Any other query token at
  position p becomes a row of its own over the keys it sees: with the sequence's block-table row
  and ``p + 1`` keys when causal (all keys when not), so the kernel's "query is the last key"
  convention places it right and ALiBi's ``slope * (k - p)`` comes out exactly (for non-causal
  rows the kernel's ALiBi is off by a per-row constant, which softmax cancels). With a sliding
  window, rows index a block-size-1 view of the cache (one slot per visible key), so the window
  is expressed by which keys a row lists; IPEX's own window is never used: it refuses
  soft-capping with it and mis-normalises rows whose window skips whole 128-key partitions.
* ``flash_attn_varlen_func`` gets the sequences with several query tokens when there is no ALiBi
  (it refuses ALiBi) and the window is not 1 (it reads a left window of 0 as "none"). It ignores
  strides, so the plan lists the blocks to copy into its ``[n, Hkv, block_size, D]`` layout.

Query tokens that see no key (cross-attention over an empty cache, or varlen queries before the
first key) are listed for the caller to zero. All index tensors are int32, converted here once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnexport.custom_ops.paged_attention import PagedAttentionCall
from attnexport.custom_ops.planning import current_step_plan, memoised

PARTITION_SIZE = 128
"""Keys per partition of IPEX's single-query kernel (PARTITION_SIZE in its source)."""
TEMP_BUDGET_BYTES = 64 * 2**20
"""Rows per single-query call are capped so IPEX's fp32 temporaries
(rows * heads * partitions * head_size) stay under this."""


@dataclass(frozen=True)
class SlotPlan:
    """A cache write without padding: IPEX has no "skip" slot (a negative one writes out of
    bounds)."""

    slots: torch.Tensor
    """(n,) int32, the non-negative slots of slot_mapping, in order."""
    keep: torch.Tensor | None
    """(n,) int64, the rows of key/value written; None when every row is."""


@dataclass(frozen=True)
class RowChunk:
    """Rows ``start:stop`` of a :class:`RowPlan`, one single-query kernel call."""

    start: int
    stop: int
    block_tables: torch.Tensor
    """(stop - start, W) int32 contiguous."""
    context_lens: torch.Tensor
    """(stop - start,) int32 contiguous, keys each row sees (>= 1)."""
    max_context_len: int


@dataclass(frozen=True)
class RowPlan:
    """Query tokens computed by the single-query kernel, one row each."""

    tokens: torch.Tensor | None
    """(R,) int64 query tokens of the rows, in row order; None when the rows are all T tokens."""
    num_rows: int
    per_token: bool
    """Block tables list slots of a block-size-1 view of the cache (windowed calls)."""
    chunks: tuple[RowChunk, ...]


@dataclass(frozen=True)
class FlashPlan:
    """Sequences computed by flash_attn_varlen_func over a copy of their blocks."""

    tokens: torch.Tensor | None
    """(Tf,) int64 query tokens of these sequences, packed in order; None when all T tokens."""
    block_ids: torch.Tensor
    """(n,) int64 cache blocks to copy, in the order the new block tables use them."""
    block_tables: torch.Tensor
    """(Sf, W) int32 into the copied blocks."""
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


@dataclass(frozen=True)
class AttentionPlan:
    rows: RowPlan | None
    flash: FlashPlan | None
    empty_tokens: torch.Tensor | None
    """(n,) int64 query tokens that see no key; their output is zero."""


@dataclass(frozen=True)
class VarlenPaging:
    """A varlen batch laid out as a paged cache, so the paged kernels can run it."""

    key_slots: torch.Tensor
    """(Tk,) int64, the cache slot of each key token."""
    num_blocks: int
    block_tables: torch.Tensor
    """(S, W) int32."""
    seq_lens: torch.Tensor
    """(S,) int32 key lengths."""


def plan_slots(slot_mapping: torch.Tensor) -> SlotPlan:
    """The int32 slots (and kept rows) for a validated ``slot_mapping`` [T] int32/int64."""
    return memoised("ipex-slots", (slot_mapping,), (), lambda: _build_slot_plan(slot_mapping))


def _build_slot_plan(slot_mapping: torch.Tensor) -> SlotPlan:
    keep = None
    slots = slot_mapping
    if slots.numel() and int(slots.min()) < 0:
        keep = (slots >= 0).nonzero().flatten()
        slots = slots.index_select(0, keep)
    return SlotPlan(slots.to(torch.int32).contiguous(), keep)


def _chunks(
    tables: torch.Tensor, lens: torch.Tensor, num_heads: int, head_size: int
) -> tuple[RowChunk, ...]:
    num_rows = lens.shape[0]
    partitions = -(-int(lens.max()) // PARTITION_SIZE)
    row_bytes = 4 * num_heads * (partitions * head_size + 2 * (partitions + 1))
    per_call = max(1, TEMP_BUDGET_BYTES // row_bytes)
    chunks = []
    for start in range(0, num_rows, per_call):
        stop = min(start + per_call, num_rows)
        chunk_lens = lens[start:stop]
        chunks.append(RowChunk(start, stop, tables[start:stop], chunk_lens, int(chunk_lens.max())))
    return tuple(chunks)


def _row_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    tokens: torch.Tensor,
    seq_of: torch.Tensor,
    key_start: torch.Tensor,
    key_end: torch.Tensor,
    num_tokens: int,
    block_size: int,
    windowed: bool,
    decode_only: bool,
    num_heads: int,
    head_size: int,
) -> RowPlan:
    seqs = seq_of.index_select(0, tokens)
    starts, ends = key_start.index_select(0, tokens), key_end.index_select(0, tokens)
    all_tokens = tokens.shape[0] == num_tokens
    if windowed:
        lens = ends - starts
        keys = starts[:, None] + torch.arange(int(lens.max()))[None, :]
        keys = torch.minimum(keys, ends[:, None] - 1)  # pad with a visible key, never read
        blocks = block_tables.to(torch.int64)[seqs[:, None], keys // block_size]
        tables = blocks * block_size + keys % block_size
    elif all_tokens and decode_only and num_tokens == seq_lens.shape[0]:  # the step's tables
        lens, tables = ends, block_tables
    else:
        lens, tables = ends, block_tables.index_select(0, seqs)
    tables = tables.to(torch.int32).contiguous()
    lens = lens.to(torch.int32).contiguous()
    return RowPlan(
        tokens=None if all_tokens else tokens,
        num_rows=tokens.shape[0],
        per_token=windowed,
        chunks=_chunks(tables, lens, num_heads, head_size),
    )


def _flash_plan(
    block_tables: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    seqs: torch.Tensor,
    tokens: torch.Tensor,
    num_tokens: int,
    block_size: int,
) -> FlashPlan:
    query_lens, key_lens = query_lens.index_select(0, seqs), seq_lens.index_select(0, seqs)
    num_blocks = (key_lens + block_size - 1) // block_size
    width = int(num_blocks.max())
    columns = torch.arange(width)[None, :]
    block_ids = block_tables.index_select(0, seqs)[:, :width][columns < num_blocks[:, None]]
    first = torch.cumsum(num_blocks, 0) - num_blocks
    tables = first[:, None] + torch.minimum(columns, num_blocks[:, None] - 1)

    def cumulative(lengths: torch.Tensor) -> torch.Tensor:
        return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)

    return FlashPlan(
        tokens=None if tokens.shape[0] == num_tokens else tokens,
        block_ids=block_ids.to(torch.int64),
        block_tables=tables.to(torch.int32).contiguous(),
        cu_seqlens_q=cumulative(query_lens),
        cu_seqlens_k=cumulative(key_lens),
        max_seqlen_q=int(query_lens.max()),
        max_seqlen_k=int(key_lens.max()),
    )


def plan_attention(call: PagedAttentionCall) -> AttentionPlan:
    """The plan of one paged-attention step (kept in the step plan for the other layers).

    ``call`` has the semantics of ``attnexport::paged_attention`` except that causal sequences
    may have more queries than keys (varlen: the first ones see nothing). Multi-token
    sequences go to flash_attn_varlen_func unless there is ALiBi (it refuses it).
    """
    query = call.query
    extra = (
        query.shape[0],
        call.key_cache.shape[1],
        call.causal,
        call.sliding_window,
        call.alibi_slopes is None,
        query.shape[1],
        query.shape[2],
    )
    metadata = (call.block_tables, call.seq_lens, call.query_start_loc)
    return memoised("ipex-paged", metadata, extra, lambda: _build_attention_plan(call))


def _build_attention_plan(call: PagedAttentionCall) -> AttentionPlan:
    block_tables, seq_lens, query_start_loc = call.block_tables, call.seq_lens, call.query_start_loc
    num_tokens, num_heads, head_size = call.query.shape
    block_size, causal, sliding_window = call.key_cache.shape[1], call.causal, call.sliding_window
    use_flash = call.alibi_slopes is None
    starts = query_start_loc.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    lens = seq_lens.to(torch.int64)
    seq_of = torch.repeat_interleave(torch.arange(lens.shape[0]), query_lens)
    position = lens[seq_of] - query_lens[seq_of] + (torch.arange(num_tokens) - starts[seq_of])
    key_end = position + 1 if causal else lens[seq_of]
    key_start = torch.zeros_like(position)
    if sliding_window > 0:
        key_start = (position - sliding_window + 1).clamp(min=0)
    empty = key_end <= key_start

    flash_seqs = (query_lens > 1) & (lens > 0)
    if not use_flash or sliding_window == 1:
        flash_seqs = torch.zeros_like(flash_seqs)
    in_flash = flash_seqs[seq_of]
    row_tokens = (~in_flash & ~empty).nonzero().flatten()
    flash_tokens = in_flash.nonzero().flatten()
    empty_tokens = empty.nonzero().flatten()

    rows = flash = None
    if row_tokens.numel():
        rows = _row_plan(
            block_tables,
            seq_lens,
            row_tokens,
            seq_of,
            key_start,
            key_end,
            num_tokens,
            block_size,
            sliding_window > 0,
            bool((query_lens == 1).all()),
            num_heads,
            head_size,
        )
    if flash_tokens.numel():
        flash = _flash_plan(
            block_tables,
            query_lens,
            lens,
            flash_seqs.nonzero().flatten(),
            flash_tokens,
            num_tokens,
            block_size,
        )
    return AttentionPlan(rows, flash, empty_tokens if empty_tokens.numel() else None)


def page_varlen(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_size: int
) -> VarlenPaging:
    """Where each key token of a varlen batch goes in a temporary paged cache (kept in the step
    plan, which then owns its tables too, so the paged plan built on them is kept as well).

    Sequence i's keys fill whole blocks of its own, in order.
    """
    tensors = (cu_seqlens_q, cu_seqlens_k)
    plan = current_step_plan()
    paging = memoised(
        "ipex-varlen", tensors, (block_size,), lambda: _page(cu_seqlens_k, block_size)
    )
    if plan is not None and plan.owns(tensors):
        plan.adopt((paging.block_tables, paging.seq_lens))
    return paging


def _page(cu_seqlens_k: torch.Tensor, block_size: int) -> VarlenPaging:
    offsets = cu_seqlens_k.to(torch.int64)
    key_lens = offsets[1:] - offsets[:-1]
    num_blocks = (key_lens + block_size - 1) // block_size
    first_block = torch.cumsum(num_blocks, 0) - num_blocks
    seq_of = torch.repeat_interleave(torch.arange(key_lens.shape[0]), key_lens)
    local = torch.arange(int(offsets[-1])) - offsets[:-1][seq_of]
    key_slots = first_block[seq_of] * block_size + local
    width = max(1, int(num_blocks.max()) if num_blocks.numel() else 1)
    tables = first_block[:, None] + torch.arange(width)[None, :]
    total_blocks = int(num_blocks.sum())
    return VarlenPaging(
        key_slots=key_slots,
        num_blocks=total_blocks,
        block_tables=tables.clamp(max=max(total_blocks - 1, 0)).to(torch.int32).contiguous(),
        seq_lens=key_lens.to(torch.int32),
    )
