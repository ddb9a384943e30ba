"""Stale values in cache slots a batch does not own (freed blocks, the rest of a sequence's
last block, block-table padding) never reach the output: every backend, with the unused slots
of the pool filled with NaN or +-Inf, matches the float64 reference (which reads only the
first ``seq_lens[i]`` keys of each sequence)."""

from __future__ import annotations

import pytest
import torch

import attnexport
from attnexport.custom_ops import reference
from tests.attention_cases import AttentionCase, fill_unused_slots, make_paged_inputs
from tests.helpers import assert_close_to_reference, paged_args, skip_unsupported

STALE_CASES = [
    AttentionCase("decode", (1, 1, 1, 1, 1), (5, 16, 31, 64, 100)),
    AttentionCase("decode", (1, 1, 1), (2, 20, 9), alibi=True, logits_soft_cap=3.0),
    AttentionCase("decode", (1, 1, 1), (2, 20, 9), sliding_window=4),
    AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
    AttentionCase("mixed", (1, 9, 1), (40, 0, 3), dtype=torch.bfloat16),
    AttentionCase("mixed", (1, 9, 1), (40, 0, 3), dtype=torch.float16, num_heads=8),
    AttentionCase("chunked", (8, 20), (24, 7), block_size=8),
    AttentionCase("empty_seq", (0, 3, 1), (4, 0, 9)),
    AttentionCase("cross", (3, 1, 6), (5, 9, 0), causal=False),
]
FILLS = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("fill", FILLS, ids=str)
@pytest.mark.parametrize("case", STALE_CASES, ids=lambda c: c.id)
def test_paged_attention_ignores_stale_slots(backend, case: AttentionCase, fill: float):
    x = fill_unused_slots(make_paged_inputs(case), fill)
    with skip_unsupported():
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    assert bool(torch.isfinite(out).all()), f"stale {fill} reached the output"
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **x["kwargs"]))
