"""xFormers attention biases that encode the attnexport masking rules (docs/ops.md).

Query j of a sequence with q queries and L keys sits at position ``p = L - q + j``
("bottom-right" alignment); key k is visible iff (not causal or k <= p) and
(sliding_window < 0 or p - k < sliding_window). The xFormers classes that say exactly that:

=========================================  ================================================
case                                       xFormers bias
=========================================  ================================================
packed keys, causal                        ``BlockDiagonalCausalFromBottomRightMask``
packed keys, causal + window               ``BlockDiagonalCausalLocalAttentionFromBottomRightMask``
packed keys, non-causal                    ``BlockDiagonalMask``
paged cache, causal                        ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``
paged cache, causal + window, 1 query/seq  ``PagedBlockDiagonalCausalWithOffsetGappyKeysMask``
                                           (keys start at ``max(0, L - window)``)
paged cache, non-causal                    ``PagedBlockDiagonalPaddedKeysMask``
ALiBi (one sequence)                       a dense ``[1, H, q, L]`` tensor: ALiBi + -inf mask
=========================================  ================================================

xFormers is imported inside the functions, so this module imports without it. Sequence lengths
are host lists (the masks keep both host and device copies); a causal sequence must have at
least as many keys as queries (the backend gives the extra queries zeros before building masks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnexport.custom_ops.reference import visible_keys

_BIAS_ALIGNMENT = 8
"""Elements; xFormers' CUTLASS operator wants 16-byte aligned rows in a tensor bias."""


def block_diagonal_bias(
    query_lens: Sequence[int],
    key_lens: Sequence[int],
    causal: bool,
    sliding_window: int,
    device: torch.device | str,
):
    """The mask of packed ragged sequences: queries ``[sum(query_lens)]`` against keys
    ``[sum(key_lens)]``, sequence i attending only to its own keys.

    Raises ValueError for a sliding window without causality (no xFormers mask for it).
    """
    from xformers.ops.fmha import attn_bias

    query_lens, key_lens = list(query_lens), list(key_lens)
    device = torch.device(device)  # xformers compares with torch.device("cpu")
    if not causal:
        if sliding_window >= 0:
            raise ValueError("sliding_window: no xformers block-diagonal mask is non-causal")
        return attn_bias.BlockDiagonalMask.from_seqlens(query_lens, key_lens, device=device)
    mask = attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(
        query_lens, key_lens, device=device
    )
    if sliding_window >= 0:
        return mask.make_local_attention_from_bottomright(sliding_window)
    return mask


def paged_bias(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_tables: torch.Tensor,
    block_size: int,
    causal: bool,
    sliding_window: int,
):
    """The mask of packed queries against a paged cache viewed as ``[1, num_blocks *
    block_size, ...]``: sequence i reads the first ``seq_lens[i]`` tokens of the blocks
    ``block_tables[i]`` (int32 ``[S, n]``, on the device of the queries).

    A sliding window is only expressible with one query per sequence (its keys then start at
    ``max(0, seq_len - window)``); anything else raises ValueError.
    """
    from xformers.ops.fmha import attn_bias

    query_lens, seq_lens = list(query_lens), list(seq_lens)
    device = block_tables.device
    if sliding_window >= 0:
        if not causal or any(q != 1 for q in query_lens):
            raise ValueError(
                "sliding_window: a paged xformers mask has a window only for causal attention "
                "with one query per sequence"
            )
        # PagedBlockDiagonalGappyKeysMask.from_seqlens rejects its own arguments in xformers
        # 0.0.32..0.0.35 (it checks len(starts) == len(lens) + 1 after asserting equality), so
        # the gappy mask is built over a notional unpaged layout, one row of the block table
        # per sequence, and converted with make_paged.
        row = block_tables.shape[1] * block_size
        starts = [max(0, n - sliding_window) for n in seq_lens]
        unpaged = attn_bias.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(
            query_lens,
            [i * row + s for i, s in enumerate(starts)] + [len(starts) * row],
            [n - s for n, s in zip(seq_lens, starts, strict=True)],
            device=device,
        )
        return unpaged.make_paged(
            block_tables,
            block_size,
            notional_padding=row,
            paged_type=attn_bias.PagedBlockDiagonalCausalWithOffsetGappyKeysMask,
        )
    cls = (
        attn_bias.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask
        if causal
        else attn_bias.PagedBlockDiagonalPaddedKeysMask
    )
    return cls.from_seqlens(query_lens, seq_lens, block_tables, block_size, device=device)


def alibi_bias(
    slopes: torch.Tensor,
    num_queries: int,
    num_keys: int,
    causal: bool,
    sliding_window: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The dense bias of one sequence: ``slopes[h] * (k - p)`` where key k is visible to the
    query at position p, ``-inf`` elsewhere.

    Args:
        slopes: ``[H]`` float ALiBi slopes, on the device of the attention.

    Returns:
        ``[1, H, num_queries, num_keys]`` in ``dtype`` (positions and products in fp32), a view
        of a buffer whose rows are padded to a multiple of 8 elements as xFormers requires.
    """
    device = slopes.device
    padded = -(-num_keys // _BIAS_ALIGNMENT) * _BIAS_ALIGNMENT
    positions = torch.arange(num_keys - num_queries, num_keys, device=device)
    distance = (
        torch.arange(num_keys, device=device, dtype=torch.float32)[None, :]
        - positions.to(torch.float32)[:, None]
    )
    bias = slopes.to(torch.float32)[:, None, None] * distance[None]
    bias = bias.masked_fill(
        ~visible_keys(positions, num_keys, causal, sliding_window)[None], float("-inf")
    )
    storage = torch.empty(1, len(slopes), num_queries, padded, dtype=dtype, device=device)
    view = storage[..., :num_keys]
    view.copy_(bias[None])
    return view
