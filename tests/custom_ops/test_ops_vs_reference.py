"""Every op on every backend against the float64 reference, over the standard case matrix."""

from __future__ import annotations

import pytest
import torch

import attnexport
from attnexport.custom_ops import reference
from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_varlen_inputs,
    standard_cases,
)
from tests.helpers import assert_close_to_reference, paged_args, skip_unsupported

CASES = standard_cases()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reshape_and_cache_matches_reference(backend, case: AttentionCase):
    x = make_paged_inputs(case)
    expected_key, expected_value = x["key_cache"].clone(), x["value_cache"].clone()
    reference.reshape_and_cache(
        x["key"], x["value"], expected_key, expected_value, x["slot_mapping"]
    )
    with skip_unsupported():
        attnexport.reshape_and_cache(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
    torch.testing.assert_close(x["key_cache"], expected_key, atol=0, rtol=0)
    torch.testing.assert_close(x["value_cache"], expected_value, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention_matches_reference(backend, case: AttentionCase):
    x = make_paged_inputs(case)
    with skip_unsupported():
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    expected = reference.paged_attention(*paged_args(x), **x["kwargs"])
    assert out.shape == x["query"].shape and out.dtype == case.dtype
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention_matches_reference(backend, case: AttentionCase):
    x = make_varlen_inputs(case)
    args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    with skip_unsupported():
        out = attnexport.varlen_attention(*args, **x["kwargs"])
    assert_close_to_reference(out, reference.varlen_attention(*args, **x["kwargs"]))


@pytest.mark.parametrize("case", CASES[:8], ids=lambda c: c.id)
def test_write_then_attend_sees_new_tokens(backend, case: AttentionCase):
    """The step a model runs: write the new tokens, then attend over context + new tokens."""
    x = make_paged_inputs(case)
    with skip_unsupported():
        attnexport.reshape_and_cache(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **x["kwargs"]))


def test_functional_cache_write_leaves_inputs_untouched(backend):
    x = make_paged_inputs(AttentionCase("mixed", (1, 9, 1), (40, 0, 3), padded_tokens=2))
    key_before, value_before = x["key_cache"].clone(), x["value_cache"].clone()
    with skip_unsupported():
        new_key, new_value = attnexport.reshape_and_cache_functional(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
    assert torch.equal(x["key_cache"], key_before) and torch.equal(x["value_cache"], value_before)
    reference.reshape_and_cache(x["key"], x["value"], key_before, value_before, x["slot_mapping"])
    assert torch.equal(new_key, key_before) and torch.equal(new_value, value_before)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_with_more_queries_than_keys(backend, causal):
    """Decoder tokens over a shorter encoder output (non-causal); with causal=True the same
    shapes are a varlen batch whose first queries see no key and must get zeros."""
    case = AttentionCase("cross", (6, 2), (-3, 3), causal=causal)
    x = make_varlen_inputs(case)  # key lengths 3 and 5
    args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    with skip_unsupported():
        out = attnexport.varlen_attention(*args, **x["kwargs"])
    expected = reference.varlen_attention(*args, **x["kwargs"])
    assert_close_to_reference(out, expected)
    if causal:
        assert torch.count_nonzero(out[:3]) == 0


def test_paged_cross_attention_with_more_queries_than_keys(backend):
    x = make_paged_inputs(AttentionCase("cross", (2, 3), (2, 0), causal=False))
    seq_lens = torch.tensor([2, 1], dtype=torch.int32)  # fewer keys than the 3 queries of seq 1
    args = (
        x["query"],
        x["key_cache"],
        x["value_cache"],
        x["block_tables"],
        seq_lens,
        x["query_start_loc"],
    )
    with skip_unsupported():
        out = attnexport.paged_attention(*args, **x["kwargs"])
    assert_close_to_reference(out, reference.paged_attention(*args, **x["kwargs"]))


def test_empty_batch(backend):
    x = make_paged_inputs(AttentionCase("one", (1,), (3,)))
    query = x["query"][:0]
    empty_i32 = torch.zeros(0, dtype=torch.int32)
    with skip_unsupported():
        out = attnexport.paged_attention(
            query,
            x["key_cache"],
            x["value_cache"],
            x["block_tables"][:0],
            empty_i32,
            torch.zeros(1, dtype=torch.int32),
            **x["kwargs"],
        )
    assert out.shape == (0, *query.shape[1:])


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.id)
def test_ops_run_on_inputs_that_require_grad(backend, case: AttentionCase):
    """A model run outside ``no_grad`` (its projections' outputs require grad) gets the same
    results (the kernels run without recording autograd history; the ops have no derivative)."""
    x = make_paged_inputs(case)
    key = x["key"].clone().requires_grad_()
    query = x["query"].clone().requires_grad_()
    with torch.enable_grad(), skip_unsupported():
        attnexport.reshape_and_cache(
            key, x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
        )
        out = attnexport.paged_attention(query, *paged_args(x)[1:], **x["kwargs"])
    expected = reference.paged_attention(*paged_args(x), **x["kwargs"])
    assert_close_to_reference(out.detach(), expected)
