"""The ReshapeAndCache and PagedAttention nodes over KV caches of a dtype of their own (float16,
bfloat16, int8 with scale caches) in onnxruntime, against the float64 reference: by their
standard-op bodies and by the native kernels."""

from __future__ import annotations

import pytest
import torch

from attnexport.custom_ops import reference
from attnexport.lowering.single_node import single_node_session
from tests.attention_cases import (
    AttentionCase,
    cache_dtype_cases,
    cache_write_args,
    make_paged_inputs,
)
from tests.helpers import ORT_KERNEL_MODES, assert_close_to_reference

# onnxruntime's CPU provider has no bfloat16 kernels for the bodies' math: bfloat16
# activations run on torch only (caches of bfloat16 under float32 activations do run).
CASES = [c for c in cache_dtype_cases() if c.dtype != torch.bfloat16]


@pytest.fixture(params=ORT_KERNEL_MODES)
def kernels(request) -> str:
    return request.param


def _scales(x: dict, suffix: str = "") -> dict:
    if x["key_scale_cache"] is None:
        return {}
    return {f"{n}{suffix}": x[n] for n in ("key_scale_cache", "value_scale_cache")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cache_write_matches_reference_exactly(case: AttentionCase, kernels: str):
    x = make_paged_inputs(case)
    expected = [None if t is None else t.clone() for t in cache_write_args(x)[2:]]
    args = cache_write_args(x)
    reference.reshape_and_cache(*args[:2], *expected[:2], args[4], *expected[3:])
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    inputs = {n: x[n] for n in names} | _scales(x)
    outputs = {"key_cache_out": x["key_cache"], "value_cache_out": x["value_cache"]}
    outputs |= _scales(x, "_out")
    session = single_node_session("ReshapeAndCache", inputs, outputs, kernels)
    session.bind(inputs).run()  # in place
    for got, want in zip(cache_write_args(x)[2:], expected, strict=True):
        if want is not None:
            torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention_matches_reference(case: AttentionCase, kernels: str):
    x = make_paged_inputs(case)
    kwargs = x["kwargs"]
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    slopes = kwargs["alibi_slopes"]
    inputs = {n: x[n] for n in names}
    inputs["alibi_slopes"] = slopes if slopes is not None else torch.zeros(case.num_heads)
    inputs |= _scales(x)
    attributes = {
        "scale": kwargs["scale"],
        "causal": int(kwargs["causal"]),
        "sliding_window": kwargs["sliding_window"],
        "logits_soft_cap": kwargs["logits_soft_cap"],
    }
    session = single_node_session(
        "PagedAttention", inputs, {"output": x["query"]}, kernels, **attributes
    )
    out = session.run(inputs)["output"]
    expected = reference.paged_attention(*(x[n] for n in names), **kwargs)
    assert out.dtype == case.dtype
    assert_close_to_reference(out, expected)


def _int8_session_inputs() -> tuple[dict, dict]:
    x = make_paged_inputs(
        AttentionCase("mixed", (1, 9, 1), (40, 0, 3), cache_dtype=torch.int8), seed=3
    )
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    inputs = {n: x[n] for n in names} | _scales(x)
    outputs = {"key_cache_out": x["key_cache"], "value_cache_out": x["value_cache"]}
    return inputs, outputs | _scales(x, "_out")


@pytest.mark.parametrize("name", ["key_scale_cache", "value_scale_cache"])
def test_body_refuses_a_scale_cache_of_another_shape(name):
    inputs, outputs = _int8_session_inputs()
    inputs[name] = inputs[name][:, :-1].contiguous()
    outputs[f"{name}_out"] = inputs[name]
    before = inputs["key_cache"].clone()
    session = single_node_session("ReshapeAndCache", inputs, outputs, "bodies")
    with pytest.raises(RuntimeError, match="invalid_shapes"):
        session.bind(inputs).run()
    assert torch.equal(inputs["key_cache"], before)  # refused before any write
