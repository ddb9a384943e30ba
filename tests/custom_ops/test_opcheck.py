"""torch.library.opcheck: schemas, fake kernels and dispatcher registrations are consistent."""

from __future__ import annotations

import pytest
import torch

import attnexport  # noqa: F401
from tests.attention_cases import AttentionCase, make_paged_inputs, make_varlen_inputs
from tests.helpers import opcheck, paged_args

CASES = [
    AttentionCase("mixed", (1, 9, 1, 5), (40, 0, 3, 12)),
    AttentionCase(
        "mixed",
        (1, 9, 1, 5),
        (40, 0, 3, 12),
        num_heads=8,
        alibi=True,
        sliding_window=7,
        logits_soft_cap=4.0,
        slot_dtype=torch.int32,
        padded_tokens=2,
    ),
    AttentionCase("cross", (3, 2), (4, 6), causal=False, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reshape_and_cache(case):
    x = make_paged_inputs(case)
    args = (x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"])
    opcheck("reshape_and_cache", args)
    opcheck("reshape_and_cache_functional", args)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention(case):
    x = make_paged_inputs(case)
    args = paged_args(x)
    opcheck("paged_attention", args, x["kwargs"])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention(case):
    x = make_varlen_inputs(case)
    args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    opcheck("varlen_attention", args, x["kwargs"])
