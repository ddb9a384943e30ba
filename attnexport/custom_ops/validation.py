"""Input validation for the attnexport ops, run before any kernel.

Two layers of checks:

* *static* checks (dtype, rank, shape relations, scalar arguments) run in both the real kernels
  and the fake kernels. Shape relations go through ``torch._check_with`` so that symbolic
  shapes under ``torch.export`` become guards instead of data-dependent errors.
* *value* checks (slot and block ids in range, monotone offsets, lengths that fit the block
  table) read tensor contents, so they only run on real tensors. Metadata tensors are shared
  by every layer of a step: inside an executor's :func:`~.planning.step_plan` their value
  checks run on the first layer and are kept in the plan; a call outside a plan (or on metadata
  the plan does not own) checks every value, every call.

Every error names the argument and the value that was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnexport.custom_ops.planning import memoised

INDEX_DTYPE = torch.int32
SLOT_DTYPES = (torch.int32, torch.int64)


def _expect(cond, message: Callable[[], str] | str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message)`` unless ``cond``; works on plain and symbolic booleans."""
    if cond is True:  # concrete shapes: skip torch._check_with, a measurable cost per op call
        return
    torch._check_with(error, cond, message if callable(message) else lambda: message)


def _expect_rank(name: str, tensor: torch.Tensor, rank: int, dims: str) -> None:
    _expect(
        tensor.dim() == rank,
        lambda: f"{name}: expected a {rank}-D tensor {dims}, got shape {tuple(tensor.shape)}",
    )


def _expect_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        expected = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {expected}, got {tensor.dtype}")


def _expect_floating(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")


def _expect_same_device(names_and_tensors: list[tuple[str, torch.Tensor]]) -> None:
    first_name, first = names_and_tensors[0]
    for name, tensor in names_and_tensors[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{name}: expected device {first.device} (the device of {first_name}), "
                f"got {tensor.device}"
            )


def _is_fake(*tensors: torch.Tensor) -> bool:
    """True while tracing (fake or meta tensors): value checks must be skipped."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)


def _check_scalars(
    scale: float,
    sliding_window: int,
    logits_soft_cap: float,
    alibi_slopes: torch.Tensor | None,
    num_heads,
    query: torch.Tensor,
) -> None:
    if not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    if sliding_window == 0:
        raise ValueError("sliding_window: expected -1 (no window) or a positive width, got 0")
    if not logits_soft_cap >= 0.0 or logits_soft_cap == float("inf"):
        raise ValueError(
            f"logits_soft_cap: expected 0.0 (disabled) or a positive finite cap, "
            f"got {logits_soft_cap!r}"
        )
    if alibi_slopes is not None:
        _expect_floating("alibi_slopes", alibi_slopes)
        _expect_rank("alibi_slopes", alibi_slopes, 1, "[num_heads]")
        _expect(
            alibi_slopes.shape[0] == num_heads,
            lambda: (
                f"alibi_slopes: expected shape [{num_heads}] (one slope per query head), "
                f"got {tuple(alibi_slopes.shape)}"
            ),
        )
        _expect_same_device([("query", query), ("alibi_slopes", alibi_slopes)])


def _check_heads(num_heads, num_kv_heads, query_name: str, kv_name: str) -> None:
    _expect(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        lambda: (
            f"{query_name}: num_heads ({num_heads}) must be a multiple of the "
            f"num_kv_heads of {kv_name} ({num_kv_heads})"
        ),
    )


def _check_offsets(name: str, offsets: torch.Tensor, total: int, total_name: str) -> torch.Tensor:
    """Checks a cumulative-offset tensor [S+1]; returns the per-sequence lengths [S] int64
    (differences taken in int64: in int32 a decreasing pair can wrap to a positive length)."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    first = int(offsets[0])
    last = int(offsets[-1])
    if first != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {first}")
    if offsets.numel() > 1 and int(lengths.min()) < 0:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets.tolist()}")
    if last != total:
        raise ValueError(f"{name}: expected {name}[-1] == {total} ({total_name}), got {last}")
    return lengths


@dataclass(frozen=True)
class BatchSummary:
    """Host-side facts about a batch, derived once from validated metadata."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    """Every sequence has exactly one query token (or none)."""
    has_context: bool
    """Some sequence with more than one query token also has cached context (chunked prefill)."""


# --------------------------------------------------------------------------- reshape_and_cache


def check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Validates a cache write; see ``attnexport::reshape_and_cache`` for the contract."""
    _expect_floating("key", key)
    _expect_rank("key", key, 3, "[num_tokens, num_kv_heads, head_size]")
    _expect_rank("value", value, 3, "[num_tokens, num_kv_heads, head_size]")
    _expect_rank("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    _expect_rank("value_cache", value_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    _expect_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _expect_dtype("slot_mapping", slot_mapping, SLOT_DTYPES)
    for name, tensor in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dtype != key.dtype:
            raise TypeError(
                f"{name}: expected dtype {key.dtype} (the dtype of key), got {tensor.dtype}"
            )
    _expect_same_device(
        [
            ("key", key),
            ("value", value),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("slot_mapping", slot_mapping),
        ]
    )
    _expect(
        key.shape[1] == key_cache.shape[2] and key.shape[2] == key_cache.shape[3],
        lambda: (
            f"key: expected [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}] "
            f"(num_kv_heads and head_size of key_cache), got {tuple(key.shape)}"
        ),
    )
    _expect(
        value.shape == key.shape,
        lambda: (
            f"value: expected shape {tuple(key.shape)} (the shape of key), got {tuple(value.shape)}"
        ),
    )
    _expect(
        value_cache.shape == key_cache.shape,
        lambda: (
            f"value_cache: expected shape {tuple(key_cache.shape)} (the shape of key_cache), "
            f"got {tuple(value_cache.shape)}"
        ),
    )
    _expect(
        slot_mapping.shape[0] == key.shape[0],
        lambda: (
            f"slot_mapping: expected shape [{key.shape[0]}] (one slot per key token), "
            f"got {tuple(slot_mapping.shape)}"
        ),
    )
    if _is_fake(key, key_cache, slot_mapping) or slot_mapping.numel() == 0:
        return
    capacity = key_cache.shape[0] * key_cache.shape[1]
    memoised("slots", (slot_mapping,), (capacity,), lambda: _check_slots(slot_mapping, capacity))


def _check_slots(slot_mapping: torch.Tensor, capacity: int) -> bool:
    """Value checks of a non-empty ``slot_mapping`` [T] int32/int64 for ``capacity`` slots."""
    largest = int(slot_mapping.max())
    if largest >= capacity:
        raise ValueError(
            f"slot_mapping: slot {largest} is out of range; expected slots < {capacity} "
            f"(num_blocks * block_size), or negative for padding"
        )
    valid = slot_mapping[slot_mapping >= 0]
    if valid.numel() > 1 and torch.unique(valid).numel() != valid.numel():
        raise ValueError("slot_mapping: expected distinct slots, got a slot written twice")
    return True


# --------------------------------------------------------------------------- paged_attention


def check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
) -> BatchSummary | None:
    """Validates a paged-attention call; returns the batch summary (None while tracing)."""
    _expect_floating("query", query)
    _expect_rank("query", query, 3, "[num_tokens, num_heads, head_size]")
    _expect_rank("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    _expect_rank("value_cache", value_cache, 4, "[num_blocks, block_size, num_kv_heads, head_size]")
    _expect_rank("block_tables", block_tables, 2, "[num_seqs, max_blocks_per_seq]")
    _expect_rank("seq_lens", seq_lens, 1, "[num_seqs]")
    _expect_rank("query_start_loc", query_start_loc, 1, "[num_seqs + 1]")
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name}: expected dtype {query.dtype} (the dtype of query), got {tensor.dtype}"
            )
    for name, tensor in (
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _expect_dtype(name, tensor, (INDEX_DTYPE,))
    _expect_same_device(
        [
            ("query", query),
            ("key_cache", key_cache),
            ("value_cache", value_cache),
            ("block_tables", block_tables),
            ("seq_lens", seq_lens),
            ("query_start_loc", query_start_loc),
        ]
    )
    _expect(
        value_cache.shape == key_cache.shape,
        lambda: (
            f"value_cache: expected shape {tuple(key_cache.shape)} (the shape of key_cache), "
            f"got {tuple(value_cache.shape)}"
        ),
    )
    _expect(
        query.shape[2] == key_cache.shape[3],
        lambda: (
            f"query: expected head_size {key_cache.shape[3]} (the head_size of key_cache), "
            f"got shape {tuple(query.shape)}"
        ),
    )
    _check_heads(query.shape[1], key_cache.shape[2], "query", "key_cache")
    num_seqs = seq_lens.shape[0]
    _expect(
        block_tables.shape[0] == num_seqs,
        lambda: (
            f"block_tables: expected {num_seqs} rows (one per sequence in seq_lens), "
            f"got shape {tuple(block_tables.shape)}"
        ),
    )
    _expect(
        query_start_loc.shape[0] == num_seqs + 1,
        lambda: (
            f"query_start_loc: expected shape [{num_seqs} + 1] (num_seqs + 1), "
            f"got {tuple(query_start_loc.shape)}"
        ),
    )
    _check_scalars(scale, sliding_window, logits_soft_cap, alibi_slopes, query.shape[1], query)
    if _is_fake(query, key_cache, block_tables, seq_lens, query_start_loc):
        return None

    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    return memoised(
        "paged",
        (block_tables, seq_lens, query_start_loc),
        (num_blocks, block_size, query.shape[0], bool(causal)),
        lambda: _summarise_paged(
            block_tables, seq_lens, query_start_loc, num_blocks, block_size, query.shape[0], causal
        ),
    )


def _summarise_paged(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_blocks: int,
    block_size: int,
    num_tokens: int,
    causal: bool,
) -> BatchSummary:
    """The value checks of a paged-attention call (shapes already checked); its summary."""
    num_seqs = seq_lens.shape[0]
    query_lens = _check_offsets("query_start_loc", query_start_loc, num_tokens, "num_tokens")
    if num_seqs == 0:
        return BatchSummary(0, 0, 0, True, False)
    if int(seq_lens.min()) < 0:
        raise ValueError(f"seq_lens: expected non-negative lengths, got {seq_lens.tolist()}")
    lens = seq_lens.to(torch.int64)  # int64 below: block counts of lengths near 2^31 wrap
    if causal:
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
    return BatchSummary(
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        decode_only=max_query_len <= 1,
        has_context=bool((multi & (lens > query_lens)).any()),
    )


# --------------------------------------------------------------------------- varlen_attention


def check_varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
) -> BatchSummary | None:
    """Validates a varlen-attention call; returns the batch summary (None while tracing)."""
    _expect_floating("query", query)
    _expect_rank("query", query, 3, "[num_query_tokens, num_heads, head_size]")
    _expect_rank("key", key, 3, "[num_key_tokens, num_kv_heads, head_size]")
    _expect_rank("value", value, 3, "[num_key_tokens, num_kv_heads, head_size]")
    _expect_rank("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    _expect_rank("cu_seqlens_k", cu_seqlens_k, 1, "[num_seqs + 1]")
    for name, tensor in (("key", key), ("value", value)):
        if tensor.dtype != query.dtype:
            raise TypeError(
                f"{name}: expected dtype {query.dtype} (the dtype of query), got {tensor.dtype}"
            )
    _expect_dtype("cu_seqlens_q", cu_seqlens_q, (INDEX_DTYPE,))
    _expect_dtype("cu_seqlens_k", cu_seqlens_k, (INDEX_DTYPE,))
    _expect_same_device(
        [
            ("query", query),
            ("key", key),
            ("value", value),
            ("cu_seqlens_q", cu_seqlens_q),
            ("cu_seqlens_k", cu_seqlens_k),
        ]
    )
    _expect(
        value.shape == key.shape,
        lambda: (
            f"value: expected shape {tuple(key.shape)} (the shape of key), got {tuple(value.shape)}"
        ),
    )
    _expect(
        query.shape[2] == key.shape[2],
        lambda: (
            f"query: expected head_size {key.shape[2]} (the head_size of key), "
            f"got shape {tuple(query.shape)}"
        ),
    )
    _check_heads(query.shape[1], key.shape[1], "query", "key")
    _expect(
        cu_seqlens_q.shape[0] == cu_seqlens_k.shape[0],
        lambda: (
            f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} (the shape of "
            f"cu_seqlens_q, num_seqs + 1), got {tuple(cu_seqlens_k.shape)}"
        ),
    )
    _expect(
        cu_seqlens_q.shape[0] >= 1,
        "cu_seqlens_q: expected at least one offset (num_seqs + 1 >= 1), got an empty tensor",
    )
    _check_scalars(scale, sliding_window, logits_soft_cap, alibi_slopes, query.shape[1], query)
    if _is_fake(query, key, cu_seqlens_q, cu_seqlens_k):
        return None

    return memoised(
        "varlen",
        (cu_seqlens_q, cu_seqlens_k),
        (query.shape[0], key.shape[0]),
        lambda: _summarise_varlen(cu_seqlens_q, cu_seqlens_k, query.shape[0], key.shape[0]),
    )


def _summarise_varlen(
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, num_queries: int, num_keys: int
) -> BatchSummary:
    """The value checks of a varlen-attention call (shapes already checked); its summary."""
    query_lens = _check_offsets("cu_seqlens_q", cu_seqlens_q, num_queries, "num_query_tokens")
    key_lens = _check_offsets("cu_seqlens_k", cu_seqlens_k, num_keys, "num_key_tokens")
    num_seqs = query_lens.numel()
    max_query_len = int(query_lens.max()) if num_seqs else 0
    return BatchSummary(
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=int(key_lens.max()) if num_seqs else 0,
        decode_only=max_query_len <= 1,
        has_context=bool(((query_lens > 1) & (key_lens > query_lens)).any()),
    )


# --------------------------------------------------------------------------- block copies


def check_block_mapping(
    name: str, src_to_dst: torch.Tensor, src_blocks: int, dst_blocks: int
) -> None:
    """Validates an ``[n, 2]`` int64 (source block, destination block) mapping."""
    _expect_dtype(name, src_to_dst, (torch.int64,))
    if src_to_dst.dim() != 2 or src_to_dst.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2], got {tuple(src_to_dst.shape)}")
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for column, ids, limit in (("source", src, src_blocks), ("destination", dst, dst_blocks)):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name}: {column} block {bad} is out of range; expected ids in [0, {limit})"
            )
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"{name}: expected distinct destination blocks, got a block written twice")


# --------------------------------------------------------------------------- rotary_embedding


def check_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Validates a rotary-embedding call (shapes and dtypes only; it reads no index)."""
    _expect_floating("x", x)
    _expect_rank("x", x, 3, "[num_tokens, num_heads, head_size]")
    _expect(
        x.shape[2] % 2 == 0,
        lambda: f"x: expected an even head_size (it rotates halves), got shape {tuple(x.shape)}",
    )
    _check_rotary_tables(x, cos, sin, "x", x.shape[2])


def check_qkv_rotary_embedding(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> None:
    """Validates a qkv_rotary_embedding call (shapes and dtypes only; it reads no index)."""
    _expect_floating("qkv", qkv)
    _expect_rank("qkv", qkv, 2, "[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]")
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if count < 1:
            raise ValueError(f"{name}: expected a positive head count, got {count}")
    _expect_rank("cos", cos, 2, "[num_tokens, head_size]")
    head_size = cos.shape[1]
    _expect(
        head_size % 2 == 0,
        lambda: f"cos: expected an even head_size (it rotates halves), got {tuple(cos.shape)}",
    )
    width = (num_heads + 2 * num_kv_heads) * head_size
    _expect(
        qkv.shape[1] == width,
        lambda: (
            f"qkv: expected {width} columns ((num_heads {num_heads} + 2 * num_kv_heads "
            f"{num_kv_heads}) * head_size {head_size}), got shape {tuple(qkv.shape)}"
        ),
    )
    _check_rotary_tables(qkv, cos, sin, "qkv", head_size)


def _check_rotary_tables(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_name: str, head_size
) -> None:
    """cos and sin: ``[T, head_size]`` in the dtype and on the device of ``x``."""
    for name, table in (("cos", cos), ("sin", sin)):
        _expect_rank(name, table, 2, "[num_tokens, head_size]")
        if table.dtype != x.dtype:
            raise TypeError(
                f"{name}: expected dtype {x.dtype} (the dtype of {x_name}), got {table.dtype}"
            )
        for axis, size in ((0, x.shape[0]), (1, head_size)):
            _expect(
                table.shape[axis] == size,
                lambda name=name, table=table: (
                    f"{name}: expected shape [{x.shape[0]}, {head_size}] (num_tokens and "
                    f"head_size of {x_name}), got {tuple(table.shape)}"
                ),
            )
    _expect_same_device([(x_name, x), ("cos", cos), ("sin", sin)])


# --------------------------------------------------------------------------- silu_and_mul


def check_silu_and_mul(x: torch.Tensor) -> None:
    """Validates a silu_and_mul call: a 2-D float tensor whose last dim holds two halves."""
    _expect_floating("x", x)
    _expect_rank("x", x, 2, "[num_tokens, 2 * d]")
    _expect(
        x.shape[1] % 2 == 0,
        lambda: f"x: expected an even last dim (gate and up halves), got shape {tuple(x.shape)}",
    )


# --------------------------------------------------------------------------- fused_add_rms_norm


def check_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """Validates a fused_add_rms_norm call (shapes, dtypes and devices)."""
    _expect_floating("x", x)
    _expect_rank("x", x, 2, "[num_tokens, hidden]")
    for name, tensor, shape in (
        ("residual", residual, tuple(x.shape)),
        ("weight", weight, (x.shape[1],)),
    ):
        if tensor.dtype != x.dtype:
            raise TypeError(
                f"{name}: expected dtype {x.dtype} (the dtype of x), got {tensor.dtype}"
            )
        _expect(
            tuple(tensor.shape) == shape,
            lambda name=name, tensor=tensor, shape=shape: (
                f"{name}: expected shape {list(shape)} (from x), got {tuple(tensor.shape)}"
            ),
        )
    _expect_same_device([("x", x), ("residual", residual), ("weight", weight)])
