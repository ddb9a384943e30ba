"""The standard-op function bodies of the attnexport nodes, run by stock onnxruntime, against
the float64 reference over the standard case matrix (and edge cases of the cache write)."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import helper

from attnexport.custom_ops import reference
from attnexport.lowering import bodies
from attnexport.lowering.metadata import ModelMetadata
from attnexport.lowering.ort_session import PagedOrtSession
from attnexport.lowering.schemas import DOMAIN, register_schemas
from attnexport.testing import AttentionCase, make_paged_inputs, make_varlen_inputs, standard_cases
from tests.helpers import assert_close_to_reference

CASES = standard_cases()
OPSET = 18
_TYPES = {
    torch.float32: onnx.TensorProto.FLOAT,
    torch.float16: onnx.TensorProto.FLOAT16,
    torch.bfloat16: onnx.TensorProto.BFLOAT16,
    torch.int32: onnx.TensorProto.INT32,
    torch.int64: onnx.TensorProto.INT64,
}


def geometry(op_type: str, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """The static-shape attributes the exporter sets on ``op_type`` for these inputs."""
    if op_type == "ReshapeAndCache":
        return {"block_size": inputs["key_cache"].shape[1]}
    paged = op_type == "PagedAttention"
    keys = inputs["key_cache"] if paged else inputs["key"]
    heads = {
        "num_heads": inputs["query"].shape[1],
        "num_kv_heads": keys.shape[-2],
        "head_size": inputs["query"].shape[2],
    }
    return heads | ({"block_size": keys.shape[1]} if paged else {})


def single_node_session(
    op_type: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor], **attributes
) -> PagedOrtSession:
    """A session of one attnexport node with its body; caches map ``X`` -> ``X_out``. The
    geometry attributes come from the inputs' shapes, as in an export."""
    register_schemas()
    attributes = geometry(op_type, inputs) | attributes

    def info(name, tensor):
        dims = [f"{name}_{i}" for i in range(tensor.dim())]
        return helper.make_tensor_value_info(name, _TYPES[tensor.dtype], dims)

    node = helper.make_node(op_type, list(inputs), list(outputs), domain=DOMAIN, **attributes)
    graph = helper.make_graph(
        [node],
        op_type,
        [info(n, t) for n, t in inputs.items()],
        [info(n, t) for n, t in outputs.items()],
    )
    written = {n.removesuffix("_out"): n for n in outputs if n.endswith("_out")}
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
        functions=bodies.all_bodies(OPSET),
        ir_version=10,
    )
    props = ModelMetadata("attnexport", tuple(written), written).to_props()
    helper.set_model_props(model, props)
    onnx.checker.check_model(model, full_check=True)
    return PagedOrtSession(model)


def _attention_attributes(kwargs: dict) -> dict:
    return {
        "scale": kwargs["scale"],
        "causal": int(kwargs["causal"]),
        "sliding_window": kwargs["sliding_window"],
        "logits_soft_cap": kwargs["logits_soft_cap"],
    }


def _slopes(case: AttentionCase, kwargs: dict) -> torch.Tensor:
    slopes = kwargs["alibi_slopes"]
    return slopes if slopes is not None else torch.zeros(case.num_heads)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention_body_matches_reference(case: AttentionCase):
    x = make_paged_inputs(case)
    inputs = {
        name: x[name]
        for name in (
            "query",
            "key_cache",
            "value_cache",
            "block_tables",
            "seq_lens",
            "query_start_loc",
        )
    }
    inputs["alibi_slopes"] = _slopes(case, x["kwargs"])
    session = single_node_session(
        "PagedAttention",
        inputs,
        {"output": x["query"]},
        **_attention_attributes(x["kwargs"]),
    )
    out = session.run(inputs)["output"]
    expected = reference.paged_attention(*list(inputs.values())[:6], **x["kwargs"])
    assert out.shape == x["query"].shape and out.dtype == case.dtype
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention_body_matches_reference(case: AttentionCase):
    x = make_varlen_inputs(case)
    inputs = {n: x[n] for n in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")}
    inputs["alibi_slopes"] = _slopes(case, x["kwargs"])
    session = single_node_session(
        "VarlenAttention",
        inputs,
        {"output": x["query"]},
        **_attention_attributes(x["kwargs"]),
    )
    out = session.run(inputs)["output"]
    expected = reference.varlen_attention(*list(inputs.values())[:5], **x["kwargs"])
    assert_close_to_reference(out, expected)


WRITE_CASES = [
    AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
    AttentionCase("mixed", (1, 9, 1), (4, 0, 3), slot_dtype=torch.int32, padded_tokens=3),
    AttentionCase("decode", (1, 1), (5, 16), padded_tokens=2, dtype=torch.bfloat16),
    AttentionCase("prefill", (7, 16), (0, 0), dtype=torch.float16, block_size=8),
]


def _write_session(x: dict) -> PagedOrtSession:
    inputs = {n: x[n] for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
    outputs = {"key_cache_out": x["key_cache"], "value_cache_out": x["value_cache"]}
    return single_node_session("ReshapeAndCache", inputs, outputs)


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_reshape_and_cache_body_writes_in_place_and_skips_padding(case: AttentionCase):
    x = make_paged_inputs(case)
    expected_key, expected_value = x["key_cache"].clone(), x["value_cache"].clone()
    reference.reshape_and_cache(
        x["key"], x["value"], expected_key, expected_value, x["slot_mapping"]
    )
    session = _write_session(x)
    key_cache, value_cache = x["key_cache"], x["value_cache"]
    pointers = key_cache.data_ptr(), value_cache.data_ptr()
    binding = session.bind(
        {n: x[n] for n in ("key", "value", "key_cache", "value_cache")}
        | {"slot_mapping": x["slot_mapping"]}
    )
    session.session.run_with_iobinding(binding)
    assert tuple(v.data_ptr() for v in binding.get_outputs()) == pointers
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


@pytest.mark.parametrize("slots", [[-1, -7, -1], []], ids=["all-padding", "no-tokens"])
def test_reshape_and_cache_body_with_nothing_to_write(slots):
    case = AttentionCase("decode", (1,), (3,))
    x = make_paged_inputs(case)
    count = len(slots)
    x["key"], x["value"] = x["key"][:1].expand(count, -1, -1), x["value"][:1].expand(count, -1, -1)
    x["key"], x["value"] = x["key"].contiguous(), x["value"].contiguous()
    x["slot_mapping"] = torch.tensor(slots, dtype=torch.int64)
    before = x["key_cache"].clone()
    session = _write_session(x)
    session.run({n: x[n] for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")})
    torch.testing.assert_close(x["key_cache"], before, atol=0, rtol=0)


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize(
    ("query_lens", "key_lens"),
    [([0, 0], [3, 5]), ([2, 1], [0, 4]), ([0], [0])],
    ids=["no-queries", "a-sequence-without-keys", "nothing"],
)
def test_varlen_attention_body_with_empty_sequences(query_lens, key_lens):
    """Encoder-decoder decode steps run the encoder on zero tokens."""
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "query": torch.randn(sum(query_lens), 4, 8, generator=generator),
        "key": torch.randn(sum(key_lens), 2, 8, generator=generator),
        "value": torch.randn(sum(key_lens), 2, 8, generator=generator),
        "cu_seqlens_q": _offsets(query_lens),
        "cu_seqlens_k": _offsets(key_lens),
        "alibi_slopes": torch.zeros(4),
    }
    attributes = {"scale": 0.3, "causal": 0, "sliding_window": -1, "logits_soft_cap": 0.0}
    session = single_node_session(
        "VarlenAttention", inputs, {"output": inputs["query"]}, **attributes
    )
    out = session.run(inputs)["output"]
    expected = reference.varlen_attention(*list(inputs.values())[:5], 0.3)
    assert out.shape == inputs["query"].shape
    assert_close_to_reference(out, expected)


def test_paged_attention_body_with_no_query_tokens():
    x = make_paged_inputs(AttentionCase("decode", (1, 1), (5, 16)))
    inputs = {
        "query": x["query"][:0],
        "key_cache": x["key_cache"],
        "value_cache": x["value_cache"],
        "block_tables": x["block_tables"],
        "seq_lens": x["seq_lens"],
        "query_start_loc": torch.zeros(3, dtype=torch.int32),
        "alibi_slopes": torch.zeros(4),
    }
    attributes = {"scale": 0.3, "causal": 0, "sliding_window": -1, "logits_soft_cap": 0.0}
    session = single_node_session(
        "PagedAttention", inputs, {"output": inputs["query"]}, **attributes
    )
    assert session.run(inputs)["output"].shape == (0, 4, 32)
