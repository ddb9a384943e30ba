"""IPEX's paged-attention kernels as custom ops of ours (namespace ``attnexport_ipex``).

IPEX registers its kernels as ``torch.ops.torch_ipex.*`` with schemas that declare no mutation,
so under inductor a read of the cache before a write returned the post-write value
(docs/traps.md). Each kernel is wrapped here in an op whose schema says what it writes, with a
fake kernel for tracing. The wrappers also check what IPEX does not (it segfaults or returns garbage
on a wrong layout, dtype or index type) before calling it.

intel_extension_for_pytorch is imported lazily, by :func:`load_ipex`, never when this module is
imported. Importing it starts an inductor compile worker unless ``TORCHINDUCTOR_COMPILE_THREADS``
is set, so the loader defaults it to 1. It also sets ``PAGED_ATTENTION_SINGLE_QUERY_KERNEL=1``:
left to its heuristic, IPEX picks a beam-search kernel when four or more consecutive sequences
share their first block (forked sequences, prefix sharing), and that kernel raises "Sliding window
unsupported" for every call without a window (measured with IPEX 2.8.0).
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnexport.custom_ops.planning import memoised

IPEX_MODULE = "intel_extension_for_pytorch"
INSTALL_HINT = 'pip install "attnexport[ipex]" (IPEX 2.8 needs torch 2.8.*)'
IPEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _major_minor(version: str) -> str | None:
    match = re.match(r"(\d+\.\d+)", version)
    return match.group(1) if match else None


def _install_problem() -> str | None:
    """Why IPEX cannot even be imported here, found without importing it (a mismatched IPEX
    exits on import)."""
    if importlib.util.find_spec(IPEX_MODULE) is None:
        return f"{IPEX_MODULE} is not installed: {INSTALL_HINT}"
    ipex_version = importlib.metadata.version("intel-extension-for-pytorch")
    if _major_minor(ipex_version) != _major_minor(torch.__version__):
        return (
            f"{IPEX_MODULE} {ipex_version} needs torch {_major_minor(ipex_version)}.*, "
            f"found torch {torch.__version__}"
        )
    return None


@functools.cache
def ipex_unavailable_reason() -> str | None:
    """Why IPEX's kernels cannot be used in this process (None when they can); imports IPEX
    once when it is installed for this torch."""
    problem = _install_problem()
    if problem is not None:
        return problem
    try:
        load_ipex()
    except Exception as error:  # any import failure makes the backend unavailable, with why
        return f"importing {IPEX_MODULE} failed: {type(error).__name__}: {error}"
    return None


@dataclass(frozen=True)
class IpexKernels:
    """IPEX's three paged-attention kernels (``torch.ops.torch_ipex.*.default``)."""

    reshape_and_cache: Callable
    single_query_cached_kv_attention: Callable
    flash_attn_varlen_func: Callable


@functools.cache
def load_ipex() -> IpexKernels:
    """Imports intel_extension_for_pytorch once and returns its kernels; raises
    ModuleNotFoundError saying why when it is not installed for this torch."""
    problem = _install_problem()
    if problem is not None:
        raise ModuleNotFoundError(problem)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    os.environ["PAGED_ATTENTION_SINGLE_QUERY_KERNEL"] = "1"  # see the module docstring
    importlib.import_module(IPEX_MODULE)
    ops = torch.ops.torch_ipex
    return IpexKernels(
        ops.reshape_and_cache.default,
        ops.single_query_cached_kv_attention.default,
        ops.flash_attn_varlen_func.default,
    )


def _head_mapping(num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The KV head of each query head, int32 [num_heads], kept in the step's plan (no global
    memo). IPEX's CPU kernel ignores it (it derives the group from the shapes) but requires it."""
    return memoised(
        "ipex-head-mapping",
        (),
        (num_heads, num_kv_heads),
        lambda: torch.arange(num_heads, dtype=torch.int32) // (num_heads // num_kv_heads),
    )


# --------------------------------------------------------------------------- checks


def _check(cond: bool, message, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message())`` unless ``cond``; messages are only formatted on failure (these
    checks run on every layer's call)."""
    if not cond:
        raise error(message() if callable(message) else message)


def _check_index(name: str, tensor: torch.Tensor, rank: int) -> None:
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name}: expected int32, got {tensor.dtype}")
    if tensor.dim() != rank or not tensor.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {rank}-D tensor (IPEX reads raw rows), got shape "
            f"{tuple(tensor.shape)} with strides {tensor.stride()}"
        )


def _check_rows(name: str, tensor: torch.Tensor, what: str) -> None:
    """IPEX reads each head as ``head_size`` adjacent elements."""
    if tensor.dim() != 3 or tensor.stride(2) != 1:
        raise ValueError(
            f"{name}: expected a 3-D tensor {what} with a contiguous head_size dimension, got "
            f"shape {tuple(tensor.shape)} with strides {tensor.stride()}"
        )


def _check_dtypes(reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    dtype = reference.dtype
    if dtype not in IPEX_DTYPES:
        names = [str(d) for d in IPEX_DTYPES]
        raise TypeError(f"{reference_name}: expected one of {names}, got {dtype}")
    for name, tensor in tensors.items():
        if tensor.dtype != dtype:
            raise TypeError(
                f"{name}: expected {dtype} (the dtype of {reference_name}), got {tensor.dtype} "
                f"(IPEX would reinterpret the memory)"
            )


def _check_cache(name: str, cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    shape = cache.shape
    if len(shape) != 4 or shape[2] != num_kv_heads or shape[3] != head_size or cache.stride(3) != 1:
        raise ValueError(
            f"{name}: expected [num_blocks, block_size, {num_kv_heads}, {head_size}] with a "
            f"contiguous head_size dimension, got shape {tuple(shape)}, strides {cache.stride()}"
        )


def _check_cpu(**tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: expected a CPU tensor, got {tensor.device}")


def _check_slots(slot_mapping: torch.Tensor, capacity: int) -> None:
    if slot_mapping.numel():
        memoised(
            "ipex-op-slots",
            (slot_mapping,),
            (capacity,),
            lambda: _check_slot_values(slot_mapping, capacity),
        )


def _check_slot_values(slot_mapping: torch.Tensor, capacity: int) -> bool:
    low, high = int(slot_mapping.min()), int(slot_mapping.max())
    _check(
        low >= 0 and high < capacity,
        f"slot_mapping: expected slots in [0, {capacity}) (IPEX has no padding slots: drop "
        f"negative ones first), got [{low}, {high}]",
    )
    return True


def _check_offsets(name: str, offsets: torch.Tensor, total: int | None) -> torch.Tensor:
    offsets = offsets.to(torch.int64)  # int32 differences of a decreasing pair can wrap
    lengths = offsets[1:] - offsets[:-1]
    _check(int(offsets[0]) == 0, f"{name}: expected {name}[0] == 0")
    _check(lengths.numel() == 0 or int(lengths.min()) >= 0, f"{name}: expected non-decreasing")
    _check(total is None or int(offsets[-1]) == total, f"{name}: expected {name}[-1] == {total}")
    return lengths


def _check_tables(
    block_tables: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    num_blocks: int,
    block_size: int,
) -> None:
    """Every block a row reads (the first ceil(lens[i] / block_size)) exists; lengths fit."""
    low, high = int(lens.min()), int(lens.max())
    _check(low >= 0, f"context lengths: expected >= 0, got {low}")
    _check(high <= max_len, f"max length {max_len} is below the longest row ({high})")
    capacity = block_tables.shape[1] * block_size
    _check(high <= capacity, f"block_tables: {capacity} slots per row cannot hold {high} tokens")
    needed = (lens.to(torch.int64) + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1]) < needed[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    _check(
        not bool(bad.any()),
        f"block_tables: expected block ids in [0, {num_blocks}) in every block a row reads",
    )


# --------------------------------------------------------------------------- ops
#
# Each op has a static check (shapes, dtypes, strides: also its fake kernel), a value check on
# real tensors (kept in the step plan when one owns the metadata, so once per step), and the
# raw call. The op runs all three; the ipex backend calls the raw function directly, its inputs
# being valid by construction (it runs inside attnexport's own op, which validated them).

_lib = torch.library.Library("attnexport_ipex", "DEF")
_lib.define(
    "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
    "Tensor slot_mapping) -> ()"
)
_lib.define(
    "single_query_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor block_tables, Tensor context_lens, int max_context_len, float scale, "
    "Tensor? alibi_slopes, int sliding_window, float logits_soft_cap) -> ()"
)
_lib.define(
    "flash_attn_varlen(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
    "bool causal, Tensor block_tables, int sliding_window, float logits_soft_cap) -> ()"
)


def _register(name: str, static, values, raw) -> None:
    """Registers the CPU kernel (all checks, then ``raw``) and the fake kernel (``static``)."""

    def kernel(*args) -> None:
        static(*args)
        values(*args)
        raw(*args)

    _lib.impl(name, kernel, "CPU")
    torch.library.register_fake(f"attnexport_ipex::{name}", static, lib=_lib)


def raw_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``torch_ipex::reshape_and_cache`` on caches in attnexport's layout, in place; the body of
    ``attnexport_ipex::reshape_and_cache``, without its checks.

    Args:
        key, value: ``[T, Hkv, D]``, head_size dimension contiguous.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]`` of the dtype of key; passed
            to IPEX as ``transpose(1, 2)`` views (its kernel honours their strides).
        slot_mapping: ``[T]`` int32, every slot in ``[0, num_blocks * block_size)``.
    """
    if key.shape[0] == 0:
        return
    load_ipex().reshape_and_cache(
        key,
        value,
        key_cache.transpose(1, 2),
        value_cache.transpose(1, 2),
        slot_mapping,
        "auto",
        1.0,
        1.0,
    )


def _static_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    _check_rows("key", key, "[num_tokens, num_kv_heads, head_size]")
    _check_rows("value", value, "[num_tokens, num_kv_heads, head_size]")
    _check(value.shape == key.shape, lambda: f"value: expected shape {tuple(key.shape)}")
    _check_dtypes("key", key, value=value, key_cache=key_cache, value_cache=value_cache)
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_cache(name, cache, key.shape[1], key.shape[2])
    _check(value_cache.shape == key_cache.shape, "value_cache: expected the shape of key_cache")
    _check_index("slot_mapping", slot_mapping, 1)
    _check(slot_mapping.shape[0] == key.shape[0], "slot_mapping: expected one slot per token")


def _values_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    _check_cpu(key=key, key_cache=key_cache, slot_mapping=slot_mapping)
    _check_slots(slot_mapping, key_cache.shape[0] * key_cache.shape[1])


_register(
    "reshape_and_cache", _static_reshape_and_cache, _values_reshape_and_cache, raw_reshape_and_cache
)


def raw_single_query_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    logits_soft_cap: float,
) -> None:
    """``torch_ipex::single_query_cached_kv_attention``: one query row over the first
    ``context_lens[r]`` keys of its block-table row; writes ``out`` in place. The body of
    ``attnexport_ipex::single_query_attention``, without its checks.

    Row r's query sits at the last of its keys, position ``n - 1`` with ``n = context_lens[r]``:
    ALiBi adds ``slope[h] * (k - (n - 1))``; a window keeps keys ``k >= n - sliding_window``.

    Args:
        out, query: ``[R, H, D]``, heads adjacent (``stride(1) == D``).
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, any strides with D
            contiguous (IPEX gets ``transpose(1, 2)`` views and honours their strides).
        block_tables: ``[R, W]`` int32 contiguous; context_lens: ``[R]`` int32, each >= 1.
        max_context_len: at least ``max(context_lens)``.
        scale: must be > 0 (IPEX applies it after masking, so a negative scale unmasks).
        alibi_slopes: None or float32 ``[H]``. sliding_window: -1 or > 0.
        logits_soft_cap: 0 (off) or > 0; not together with a window (IPEX refuses it).
    """
    if query.shape[0] == 0:
        return
    load_ipex().single_query_cached_kv_attention(
        out,
        query,
        key_cache.transpose(1, 2),
        value_cache.transpose(1, 2),
        _head_mapping(query.shape[1], key_cache.shape[2]),
        scale,
        block_tables,
        context_lens,
        key_cache.shape[1],
        max_context_len,
        alibi_slopes,
        sliding_window,
        1.0,
        1.0,
        logits_soft_cap if logits_soft_cap > 0 else -1.0,
    )


def _static_single_query(
    out,
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    max_len,
    scale,
    alibi,
    window,
    cap,
) -> None:
    _check_rows("query", query, "[num_rows, num_heads, head_size]")
    _check(
        query.stride(1) == query.shape[2],
        "query: expected adjacent heads (stride(1) == head_size): IPEX steps through a "
        "KV head's query group by head_size",
    )
    _check(out.shape == query.shape, lambda: f"out: expected shape {tuple(query.shape)}")
    _check_rows("out", out, "[num_rows, num_heads, head_size]")
    _check_dtypes("query", query, out=out, key_cache=key_cache, value_cache=value_cache)
    _check_cache("key_cache", key_cache, key_cache.shape[2], query.shape[2])
    _check(value_cache.shape == key_cache.shape, "value_cache: expected the shape of key_cache")
    _check(
        query.shape[1] % key_cache.shape[2] == 0,
        "query: num_heads must be a multiple of num_kv_heads",
    )
    _check_index("block_tables", block_tables, 2)
    _check_index("context_lens", context_lens, 1)
    _check(
        block_tables.shape[0] == query.shape[0] and context_lens.shape[0] == query.shape[0],
        "block_tables, context_lens: expected one row per query row",
    )
    if alibi is not None:
        _check(
            alibi.dtype == torch.float32
            and alibi.is_contiguous()
            and tuple(alibi.shape) == (query.shape[1],),
            "alibi_slopes: expected a contiguous float32 [num_heads] tensor",
            TypeError,
        )
    _check(window == -1 or window > 0, "sliding_window: expected -1 or > 0")
    _check(
        not (window > 0 and cap > 0),
        "sliding_window with logits_soft_cap: IPEX's single-query kernel refuses the pair",
    )
    _check(scale > 0, lambda: f"scale: expected > 0, got {scale}")


def _values_single_query(
    out, query, key_cache, value_cache, block_tables, context_lens, max_len, *options
) -> None:
    _check_cpu(query=query, key_cache=key_cache, block_tables=block_tables)
    if query.shape[0] == 0:
        return
    extra = (max_len, key_cache.shape[0], key_cache.shape[1])

    def check() -> bool:
        _check(int(context_lens.min()) >= 1, "context_lens: every row needs at least one key")
        _check_tables(block_tables, context_lens, max_len, *extra[1:])
        return True

    memoised("ipex-op-rows", (block_tables, context_lens), extra, check)


_register(
    "single_query_attention",
    _static_single_query,
    _values_single_query,
    raw_single_query_attention,
)


def raw_flash_attn_varlen(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
    block_tables: torch.Tensor,
    sliding_window: int,
    logits_soft_cap: float,
) -> None:
    """``torch_ipex::flash_attn_varlen_func``: packed queries over paged keys, bottom-right
    aligned (query j of q over k keys sits at ``k - q + j``), as in ``attnexport::paged_attention``;
    writes ``out`` in place. A query that sees no key gets NaN (callers zero it). The body of
    ``attnexport_ipex::flash_attn_varlen``, without its checks.

    Args:
        out, query: ``[T, H, D]``, D contiguous.
        key_cache, value_cache: contiguous ``[num_blocks, Hkv, block_size, D]`` (IPEX's layout:
            this kernel ignores strides, so a transposed view of attnexport's layout is wrong).
        cu_seqlens_q, cu_seqlens_k: ``[S + 1]`` int32 cumulative query and key counts.
        max_seqlen_q, max_seqlen_k: at least the longest query and key sequence.
        block_tables: ``[S, W]`` int32 contiguous.
        sliding_window: -1 or >= 2 (IPEX reads a left window of 0 as "no window", so 1 cannot
            be expressed).
        scale: must be > 0. logits_soft_cap: 0 (off) or > 0. No ALiBi (IPEX refuses it).
    """
    if query.shape[0] == 0:
        return
    load_ipex().flash_attn_varlen_func(
        out,
        query,
        key_cache,
        value_cache,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        scale,
        causal,
        block_tables,
        None,
        sliding_window - 1 if sliding_window > 0 else -1,
        -1,
        "auto",
        1.0,
        1.0,
        logits_soft_cap if logits_soft_cap > 0 else -1.0,
    )


def _static_flash(
    out, query, key_cache, value_cache, cu_q, cu_k, max_q, max_k, scale, causal, tables, window, cap
) -> None:
    _check_rows("query", query, "[num_tokens, num_heads, head_size]")
    _check(out.shape == query.shape, lambda: f"out: expected shape {tuple(query.shape)}")
    _check_rows("out", out, "[num_tokens, num_heads, head_size]")
    _check_dtypes("query", query, out=out, key_cache=key_cache, value_cache=value_cache)
    _check(
        key_cache.dim() == 4 and key_cache.shape[3] == query.shape[2],
        lambda: (
            f"key_cache: expected [num_blocks, num_kv_heads, block_size, {query.shape[2]}] "
            f"(IPEX's layout), got {tuple(key_cache.shape)}"
        ),
    )
    _check(value_cache.shape == key_cache.shape, "value_cache: expected the shape of key_cache")
    _check(
        key_cache.is_contiguous() and value_cache.is_contiguous(),
        "key_cache, value_cache: expected contiguous [num_blocks, num_kv_heads, block_size, "
        "head_size] tensors: flash_attn_varlen_func ignores strides",
    )
    _check(
        query.shape[1] % key_cache.shape[1] == 0,
        "query: num_heads must be a multiple of num_kv_heads",
    )
    _check_index("cu_seqlens_q", cu_q, 1)
    _check_index("cu_seqlens_k", cu_k, 1)
    _check_index("block_tables", tables, 2)
    _check(
        cu_k.shape == cu_q.shape and tables.shape[0] == cu_q.shape[0] - 1,
        "cu_seqlens_q, cu_seqlens_k, block_tables: expected S + 1, S + 1 and S rows",
    )
    _check(scale > 0, lambda: f"scale: expected > 0, got {scale}")
    _check(
        window == -1 or window >= 2, lambda: f"sliding_window: expected -1 or >= 2, got {window}"
    )


def _values_flash(
    out, query, key_cache, value_cache, cu_q, cu_k, max_q, max_k, scale, causal, tables, *options
) -> None:
    _check_cpu(query=query, key_cache=key_cache, block_tables=tables)
    if query.shape[0] == 0:
        return
    extra = (query.shape[0], max_q, max_k, key_cache.shape[0], key_cache.shape[2])

    def check() -> bool:
        query_lens = _check_offsets("cu_seqlens_q", cu_q, query.shape[0])
        _check(int(query_lens.max()) <= max_q, "max_seqlen_q: below the longest query")
        key_lens = _check_offsets("cu_seqlens_k", cu_k, None)
        _check_tables(tables, key_lens, max_k, *extra[3:])
        return True

    memoised("ipex-op-flash", (cu_q, cu_k, tables), extra, check)


_register("flash_attn_varlen", _static_flash, _values_flash, raw_flash_attn_varlen)
