"""What the two attention ops (``paged_attention``, ``varlen_attention``) share: the arguments
that shape the logits (scale, mask, ALiBi, soft-cap), their checks, and the description of a
call that backend selection reads."""

from __future__ import annotations

from typing import Protocol

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.dispatch import AttentionCall

OPTION_ARGS = (
    "float scale, bool causal={}, Tensor? alibi_slopes=None, int sliding_window=-1, "
    "float logits_soft_cap=0.0"
)
"""The schema of the logits options; ``{}`` is the op's default of ``causal``."""


class AttentionOptions(Protocol):
    """The logits options of an attention call (fields of its typed call)."""

    query: torch.Tensor
    scale: float
    causal: bool
    alibi_slopes: torch.Tensor | None
    sliding_window: int
    logits_soft_cap: float


def options(call: AttentionOptions) -> tuple[float, bool, torch.Tensor | None, int, float]:
    """``(scale, causal, alibi_slopes, sliding_window, logits_soft_cap)`` of ``call``."""
    return call.scale, call.causal, call.alibi_slopes, call.sliding_window, call.logits_soft_cap


def check_options(call: AttentionOptions) -> None:
    """Static checks of the logits options (``query``: ``[T, H, D]``, H slopes for ALiBi)."""
    scale, query = call.scale, call.query
    if not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"scale: expected a finite float, got {scale!r}")
    if call.sliding_window == 0:
        raise ValueError("sliding_window: expected -1 (no window) or a positive width, got 0")
    cap = call.logits_soft_cap
    if not cap >= 0.0 or cap == float("inf"):
        raise ValueError(
            f"logits_soft_cap: expected 0.0 (disabled) or a positive finite cap, got {cap!r}"
        )
    check_per_head("alibi_slopes", call.alibi_slopes, query)


def check_per_head(name: str, values: torch.Tensor | None, query: torch.Tensor) -> None:
    """Checks optional argument ``name``: one float per query head of ``query`` [T, H, D]."""
    if values is None:
        return
    num_heads = query.shape[1]
    checks.expect_floating(name, values)
    checks.expect_rank(name, values, 1, "[num_heads]")
    checks.expect(
        values.shape[0] == num_heads,
        lambda: (
            f"{name}: expected shape [{num_heads}] (one per query head), got {tuple(values.shape)}"
        ),
    )
    checks.expect_same_device(("query", name), (query, values))


def describe(
    op: str,
    call: AttentionOptions,
    num_kv_heads: int,
    summary: checks.BatchSummary,
    block_size: int | None = None,
    cache_contiguous: bool = True,
    cache_dtype: torch.dtype | None = None,
) -> AttentionCall:
    """What a validated attention call asks of a backend (selection reads it)."""
    query = call.query
    return AttentionCall(
        op=op,
        device_type=query.device.type,
        dtype=query.dtype,
        num_heads=query.shape[1],
        num_kv_heads=num_kv_heads,
        head_size=query.shape[2],
        block_size=block_size,
        causal=call.causal,
        alibi=call.alibi_slopes is not None,
        sliding_window=call.sliding_window >= 0,
        soft_cap=call.logits_soft_cap > 0,
        sinks=getattr(call, "sinks", None) is not None,
        decode_only=summary.decode_only,
        chunked_prefill=summary.has_context,
        cache_contiguous=cache_contiguous,
        cache_dtype=cache_dtype,
    )
