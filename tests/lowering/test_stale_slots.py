"""Stale values in cache slots a batch does not own never reach the output of the
PagedAttention node, run by its standard-op body (stock onnxruntime) and by the native kernel:
with the unused slots filled with NaN or +-Inf, both match the float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnexport.custom_ops import reference
from tests.attention_cases import fill_unused_slots, make_paged_inputs
from tests.custom_ops.test_stale_slots import FILLS, STALE_CASES
from tests.helpers import ORT_KERNEL_MODES, assert_close_to_reference
from tests.lowering.test_bodies import _attention_session, _slopes


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
@pytest.mark.parametrize("fill", FILLS, ids=str)
@pytest.mark.parametrize("case", STALE_CASES, ids=lambda c: c.id)
def test_paged_attention_node_ignores_stale_slots(case, fill: float, kernels: str):
    x = fill_unused_slots(make_paged_inputs(case), fill)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    inputs = {n: x[n] for n in names} | {"alibi_slopes": _slopes(case, x["kwargs"])}
    out = _attention_session(inputs, x["kwargs"], kernels).run(inputs)["output"]
    assert bool(torch.isfinite(out).all()), f"stale {fill} reached the output"
    expected = reference.paged_attention(*list(inputs.values())[:6], **x["kwargs"])
    assert_close_to_reference(out, expected)
