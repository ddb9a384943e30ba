"""The reference semantics of the attnexport ops, written for clarity, not speed.

Each op's reference lives in its slice (``attnexport.custom_ops.<op>.reference``) and follows
docs/ops.md line by line, one sequence at a time, computing in ``compute_dtype`` (float64 by
default); ``reference.<op>`` names it here. Tests compare every backend with these; they are
also the executable definition of the masking rules, whose shared part is below.
"""

from __future__ import annotations

from collections.abc import Callable

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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one sequence: query [q, H, D] over key/value [L, Hkv, D]; ``sinks`` [H]:
    a logit per head in each softmax, the logit of a key whose value is zero.

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
    if sinks is not None:  # the sink's column joins the softmax, then is dropped
        sink = sinks.to(compute_dtype)[:, None, None].expand(*logits.shape[:2], 1)
        logits = torch.cat([logits, sink], dim=-1)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    weights = weights[..., : key.shape[0]]
    return torch.einsum("hqk,khd->qhd", weights, v)


def __getattr__(name: str) -> Callable:
    """``reference.<op>``: the reference of op ``<op>``, from the op registry."""
    if name.startswith("__"):  # import machinery probes (__path__, ...): never an op
        raise AttributeError(name)
    from attnexport.custom_ops.registry import OP_SPECS

    spec = OP_SPECS.get(name)
    if spec is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return spec.reference
