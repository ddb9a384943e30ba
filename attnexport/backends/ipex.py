"""The ``ipex`` backend: Intel Extension for PyTorch's paged-attention kernels on CPU.

* cache writes: ``reshape_and_cache`` (padding slots dropped first: IPEX has none);
* decode tokens, and every query token when there is ALiBi or a window of 1: the single-query
  kernel, one row per token (see :mod:`.ipex_plan` for how prefill rows are expressed exactly);
* other multi-token sequences (prefill, chunked prefill, cross-attention): flash_attn_varlen_func
  over a copy of their blocks in IPEX's layout (that kernel ignores strides);
* ``varlen_attention``: the same, after laying the keys out as a temporary paged cache.

Each IPEX kernel is wrapped in an ``attnexport_ipex`` op (:mod:`.ipex_kernels`) that declares
its writes and checks its inputs, for code that calls the kernels under torch.compile or
torch.export. This backend always runs inside an ``attnexport`` op (opaque to both, inputs
already validated) and calls the same kernels through their raw functions, which saves the
dispatcher hop and the repeated checks on every layer (docs/benchmarks.md). Metadata
work (int32 tables, row lists) is planned once per step and reused by every layer. IPEX is
imported on first use, never by ``import attnexport``. Numerics: fp32 within about 1e-6 of the
float64 reference at usual scales; bf16/fp16 round once, at the output.
"""

from __future__ import annotations

import torch

from attnexport.backends import ipex_kernels, ipex_plan
from attnexport.custom_ops import attention
from attnexport.custom_ops.backend import AttentionBackend
from attnexport.custom_ops.dispatch import OPS, AttentionCall, BackendCapabilities
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from attnexport.custom_ops.reshape_and_cache import CacheWriteCall
from attnexport.custom_ops.varlen_attention import VarlenAttentionCall

VARLEN_BLOCK_SIZE = 64
"""Block size of the temporary paged cache built for ``varlen_attention``."""


def _heads_adjacent(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` [N, H, D] itself when IPEX can read it (heads adjacent), else a copy."""
    if tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]:
        return tensor
    return tensor.contiguous()


def _positive_scale(query: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """IPEX scales after masking (-inf * negative = +inf): fold a sign into the query."""
    if scale > 0:
        return query, scale
    if scale < 0:
        return -query, -scale
    return torch.zeros_like(query), 1.0


def _run_rows(
    plan: ipex_plan.RowPlan,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    logits_soft_cap: float,
) -> None:
    rows_query = query if plan.tokens is None else query.index_select(0, plan.tokens)
    rows_out = out if plan.tokens is None else torch.empty_like(rows_query)
    if plan.per_token:  # one slot per block: tables list the visible keys' slots
        key_cache = key_cache.view(-1, 1, *key_cache.shape[2:])
        value_cache = value_cache.view(-1, 1, *value_cache.shape[2:])
    single = len(plan.chunks) == 1
    for chunk in plan.chunks:
        ipex_kernels.raw_single_query_attention(
            rows_out if single else rows_out[chunk.start : chunk.stop],
            rows_query if single else rows_query[chunk.start : chunk.stop],
            key_cache,
            value_cache,
            chunk.block_tables,
            chunk.context_lens,
            chunk.max_context_len,
            scale,
            alibi_slopes,
            -1,
            logits_soft_cap,
        )
    if plan.tokens is not None:
        out.index_copy_(0, plan.tokens, rows_out)


def _ipex_layout(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``block_ids`` of a [NB, BS, Hkv, D] cache as contiguous [n, Hkv, BS, D]."""
    return cache.permute(0, 2, 1, 3).index_select(0, block_ids).contiguous()


def _run_flash(
    plan: ipex_plan.FlashPlan,
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int,
    logits_soft_cap: float,
) -> None:
    flash_query = query if plan.tokens is None else query.index_select(0, plan.tokens)
    flash_out = out if plan.tokens is None else torch.empty_like(flash_query)
    ipex_kernels.raw_flash_attn_varlen(
        flash_out,
        flash_query,
        _ipex_layout(key_cache, plan.block_ids),
        _ipex_layout(value_cache, plan.block_ids),
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        scale,
        causal,
        plan.block_tables,
        sliding_window,
        logits_soft_cap,
    )
    if plan.tokens is not None:
        out.index_copy_(0, plan.tokens, flash_out)


def _attend(call: PagedAttentionCall) -> torch.Tensor:
    """Paged attention of ``call`` (causal sequences may also have more queries than keys: the
    first ones see nothing and get zeros)."""
    plan = ipex_plan.plan_attention(call)
    key_cache, value_cache, alibi_slopes = call.key_cache, call.value_cache, call.alibi_slopes
    causal, sliding_window, logits_soft_cap = call.causal, call.sliding_window, call.logits_soft_cap
    query, scale = _positive_scale(_heads_adjacent(call.query), call.scale)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if plan.rows is not None:
        if alibi_slopes is not None:
            alibi_slopes = alibi_slopes.to(torch.float32).contiguous()
        _run_rows(
            plan.rows, out, query, key_cache, value_cache, scale, alibi_slopes, logits_soft_cap
        )
    if plan.flash is not None:
        _run_flash(
            plan.flash,
            out,
            query,
            key_cache,
            value_cache,
            scale,
            causal,
            sliding_window,
            logits_soft_cap,
        )
    if plan.empty_tokens is not None:
        out.index_fill_(0, plan.empty_tokens, 0)
    return out


class IpexBackend(AttentionBackend):
    """IPEX's CPU kernels; covers the whole op contract for fp32, bf16 and fp16 on CPU."""

    name = "ipex"
    priority = 10
    capabilities = BackendCapabilities(
        ops=frozenset(OPS),
        devices=frozenset({"cpu"}),
        dtypes=frozenset(ipex_kernels.IPEX_DTYPES),
        # Measured with IPEX 2.8 on CPU: reshape_and_cache, single_query_cached_kv_attention
        # and flash_attn_varlen_func all fail with "expected scalar type Float but found
        # BFloat16" (Half, Char) for float32 queries over bfloat16 (float16, int8) caches.
        cache_dtype_reason=(
            "IPEX 2.8's paged kernels take caches of the query's dtype only (its kernels fail "
            "with 'expected scalar type Float but found BFloat16' for a bfloat16 cache under "
            "float32 queries) and have no int8 cache with per-row scales"
        ),
        notes=(
            "caches must be contiguous; intel_extension_for_pytorch is imported on first use",
            "prefill with ALiBi or sliding_window=1 runs one single-query row per token "
            "(flash_attn_varlen_func refuses ALiBi and cannot express a window of 1)",
            "prefill otherwise copies the sequences' blocks to IPEX's [n, Hkv, bs, D] layout",
        ),
    )

    def unavailable_reason(self) -> str | None:
        return ipex_kernels.ipex_unavailable_reason()

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = super().not_supported_reasons(call)
        if self.is_available() and call.op != "varlen_attention" and not call.cache_contiguous:
            reasons.append(
                "non-contiguous caches (IPEX indexes contiguous [num_blocks, block_size, "
                "num_kv_heads, head_size] caches)"
            )
        return reasons

    def reshape_and_cache(self, call: CacheWriteCall) -> None:
        key, value = call.key, call.value
        plan = ipex_plan.plan_slots(call.slot_mapping)
        if plan.keep is not None:
            key, value = key.index_select(0, plan.keep), value.index_select(0, plan.keep)
        ipex_kernels.raw_reshape_and_cache(
            key if key.stride(2) == 1 else key.contiguous(),
            value if value.stride(2) == 1 else value.contiguous(),
            call.key_cache,
            call.value_cache,
            plan.slots,
        )

    def paged_attention(self, call: PagedAttentionCall) -> torch.Tensor:
        return _attend(call)

    def varlen_attention(self, call: VarlenAttentionCall) -> torch.Tensor:
        key, value = call.key, call.value
        paging = ipex_plan.page_varlen(call.cu_seqlens_q, call.cu_seqlens_k, VARLEN_BLOCK_SIZE)
        shape = (paging.num_blocks, VARLEN_BLOCK_SIZE, *key.shape[1:])
        key_cache, value_cache = key.new_empty(shape), value.new_empty(shape)
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, paging.key_slots, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, paging.key_slots, value)
        return _attend(
            PagedAttentionCall(
                call.query,
                key_cache,
                value_cache,
                paging.block_tables,
                paging.seq_lens,
                call.cu_seqlens_q,
                *attention.options(call),
            )
        )
