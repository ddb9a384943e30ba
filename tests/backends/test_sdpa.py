"""The sdpa backend's decode path: chunking, workspace reuse and per-step plans."""

from __future__ import annotations

import pytest
import torch

import attnexport
from attnexport.backends import sdpa
from attnexport.custom_ops import reference, step_plan, use_backend
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from tests.attention_cases import AttentionCase, make_paged_inputs
from tests.helpers import assert_close_to_reference, paged_args


def _plan(x: dict, case: AttentionCase):
    call = PagedAttentionCall(*paged_args(x), **x["kwargs"])
    return sdpa._plan_step(call, torch.float32)


@pytest.mark.parametrize(
    "case",
    [
        AttentionCase("decode", (1, 1, 1, 1, 1), (5, 16, 31, 64, 100), dtype=torch.bfloat16),
        AttentionCase("mixed", (1, 9, 1, 0, 1), (40, 0, 3, 7, 70), alibi=True, sliding_window=9),
    ],
    ids=lambda c: c.id,
)
def test_decode_in_several_chunks_matches_reference(case, monkeypatch):
    monkeypatch.setattr(sdpa, "_DECODE_CHUNK_BYTES", 1)  # one sequence per chunk
    x = make_paged_inputs(case)
    with use_backend("sdpa"):
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    assert len(_plan(x, case).decode) == case.query_lens.count(1)
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **x["kwargs"]))


def test_layers_reuse_the_step_plan_and_the_workspace():
    case = AttentionCase("decode", (1, 1, 1), (30, 2, 17))
    x = make_paged_inputs(case)
    metadata = (x["block_tables"], x["seq_lens"], x["query_start_loc"])
    with use_backend("sdpa"), step_plan(metadata):
        attnexport.paged_attention(*paged_args(x), **x["kwargs"])  # layer 0
        plan, buffers = _plan(x, case), dict(sdpa._workspace.buffers)
        attnexport.paged_attention(*paged_args(x), **x["kwargs"])  # layer 1
        assert _plan(x, case) is plan
    assert all(sdpa._workspace.buffers[k] is v for k, v in buffers.items())
    x["seq_lens"][0] -= 1  # the next step edits the metadata in place: planned again
    with step_plan(metadata):
        assert _plan(x, case) is not plan
