"""The attnexport nodes in onnxruntime against the float64 reference over the standard case
matrix (and edge cases of the cache write): run by their standard-op function bodies (stock
onnxruntime) and by the native kernels of :mod:`attnexport.ort_kernels` (``kernels``)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import attnexport
from attnexport.custom_ops import reference
from attnexport.lowering.ort_session import PagedOrtSession
from attnexport.lowering.single_node import single_node_session
from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_rotary_inputs,
    make_varlen_inputs,
    standard_cases,
)
from tests.helpers import ORT_KERNEL_MODES, assert_close_to_reference, requires_ort_kernels

CASES = standard_cases()


@pytest.fixture(params=ORT_KERNEL_MODES)
def kernels(request) -> str:
    return request.param


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


def _paged_inputs(case: AttentionCase) -> tuple[dict, dict]:
    """The PagedAttention node's inputs for ``case`` and the reference's keyword arguments."""
    x = make_paged_inputs(case)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    inputs = {n: x[n] for n in names} | {"alibi_slopes": _slopes(case, x["kwargs"])}
    if case.sinks:
        inputs["sinks"] = x["kwargs"]["sinks"]
    return inputs, x["kwargs"]


def _attention_session(
    inputs: dict, kwargs: dict, kernels: str, op_type: str = "PagedAttention"
) -> PagedOrtSession:
    """A session of one attention node (``op_type``) with the reference's ``kwargs``."""
    output = {"output": inputs["query"]}
    attributes = _attention_attributes(kwargs)
    return single_node_session(op_type, inputs, output, kernels, **attributes)


def _check_paged_attention(case: AttentionCase, kernels: str) -> None:
    inputs, kwargs = _paged_inputs(case)
    out = _attention_session(inputs, kwargs, kernels).run(inputs)["output"]
    expected = reference.paged_attention(*list(inputs.values())[:6], **kwargs)
    assert out.shape == inputs["query"].shape and out.dtype == case.dtype
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_paged_attention_matches_reference(case: AttentionCase, kernels: str):
    _check_paged_attention(case, kernels)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_varlen_attention_body_matches_reference(case: AttentionCase, kernels: str):
    """``native``: a session with the kernel library still runs this node (no native kernel)
    through its body."""
    x = make_varlen_inputs(case)
    inputs = {n: x[n] for n in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")}
    inputs["alibi_slopes"] = _slopes(case, x["kwargs"])
    session = _attention_session(inputs, x["kwargs"], kernels, "VarlenAttention")
    out = session.run(inputs)["output"]
    expected = reference.varlen_attention(*list(inputs.values())[:5], **x["kwargs"])
    assert_close_to_reference(out, expected)


WRITE_CASES = [
    AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
    AttentionCase("mixed", (1, 9, 1), (4, 0, 3), slot_dtype=torch.int32, padded_tokens=3),
    AttentionCase("decode", (1, 1), (5, 16), padded_tokens=2, dtype=torch.bfloat16),
    AttentionCase("prefill", (7, 16), (0, 0), dtype=torch.float16, block_size=8),
]


def _write_session(x: dict, kernels: str) -> PagedOrtSession:
    inputs = {n: x[n] for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
    outputs = {"key_cache_out": x["key_cache"], "value_cache_out": x["value_cache"]}
    return single_node_session("ReshapeAndCache", inputs, outputs, kernels)


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_reshape_and_cache_writes_in_place_and_skips_padding(case: AttentionCase, kernels: str):
    x = make_paged_inputs(case)
    expected_key, expected_value = x["key_cache"].clone(), x["value_cache"].clone()
    reference.reshape_and_cache(
        x["key"], x["value"], expected_key, expected_value, x["slot_mapping"]
    )
    session = _write_session(x, kernels)
    key_cache, value_cache = x["key_cache"], x["value_cache"]
    pointers = key_cache.data_ptr(), value_cache.data_ptr()
    step = session.bind(
        {n: x[n] for n in ("key", "value", "key_cache", "value_cache")}
        | {"slot_mapping": x["slot_mapping"]}
    )
    assert tuple(v.data_ptr() for v in step.run()) == pointers
    torch.testing.assert_close(key_cache, expected_key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache, expected_value, atol=0, rtol=0)


@pytest.mark.parametrize("slots", [[-1, -7, -1], []], ids=["all-padding", "no-tokens"])
def test_reshape_and_cache_with_nothing_to_write(slots, kernels: str):
    case = AttentionCase("decode", (1,), (3,))
    x = make_paged_inputs(case)
    count = len(slots)
    x["key"], x["value"] = x["key"][:1].expand(count, -1, -1), x["value"][:1].expand(count, -1, -1)
    x["key"], x["value"] = x["key"].contiguous(), x["value"].contiguous()
    x["slot_mapping"] = torch.tensor(slots, dtype=torch.int64)
    before = x["key_cache"].clone()
    session = _write_session(x, kernels)
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


def test_paged_attention_with_no_query_tokens(kernels: str):
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
        "PagedAttention", inputs, {"output": inputs["query"]}, kernels, **attributes
    )
    assert session.run(inputs)["output"].shape == (0, 4, 32)


# ------------------------------------------------------------------ the native kernels only


@requires_ort_kernels
@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda i: i["block_tables"].__setitem__((0, 0), 10**6),
            r"block_tables\[0, 0\] = 1000000 is not a block id in \[0, ",
        ),
        (
            lambda i: i["seq_lens"].__setitem__(0, 10**6),
            r"seq_lens\[0\] = 1000000 is outside \[0, max_blocks \* block_size",
        ),
        (
            lambda i: i["query_start_loc"].__setitem__(-1, 10**6),
            r"query_start_loc must be non-decreasing and <= num_tokens",
        ),
    ],
    ids=["block-id", "seq-len", "query-offsets"],
)
def test_native_paged_attention_refuses_bad_indices_before_reading(change, message):
    """The kernel reads the cache through these indices: it checks them first and names them."""
    inputs, kwargs = _paged_inputs(AttentionCase("mixed", (1, 9, 1), (4, 0, 3)))
    session = _attention_session(inputs, kwargs, "native")
    change(inputs)
    with pytest.raises(Exception, match=message):
        session.run(inputs)


@requires_ort_kernels
def test_native_reshape_and_cache_refuses_a_slot_past_the_cache():
    x = make_paged_inputs(AttentionCase("decode", (1, 1), (5, 16)))
    session = _write_session(x, "native")
    x["slot_mapping"] = x["slot_mapping"].clone()
    x["slot_mapping"][1] = x["key_cache"].shape[0] * x["key_cache"].shape[1]
    before = x["key_cache"].clone()
    with pytest.raises(Exception, match=r"slot_mapping\[1\] = \d+ is past the cache's \d+ slots"):
        session.run({n: x[n] for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")})
    torch.testing.assert_close(x["key_cache"], before, atol=0, rtol=0)


@requires_ort_kernels
def test_native_reshape_and_cache_without_binding_returns_new_caches():
    """A plain ``run`` (outputs not bound to the inputs): the kernel copies each cache into its
    new output before writing, so the result equals the in-place one and the input is kept."""
    x = make_paged_inputs(WRITE_CASES[0])
    expected_key, expected_value = x["key_cache"].clone(), x["value_cache"].clone()
    reference.reshape_and_cache(
        x["key"], x["value"], expected_key, expected_value, x["slot_mapping"]
    )
    before = x["key_cache"].clone()
    session = _write_session(x, "native").session
    feeds = {n: x[n].numpy() for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
    key_out, value_out = session.run(["key_cache_out", "value_cache_out"], feeds)
    torch.testing.assert_close(torch.from_numpy(key_out), expected_key, atol=0, rtol=0)
    torch.testing.assert_close(torch.from_numpy(value_out), expected_value, atol=0, rtol=0)
    torch.testing.assert_close(x["key_cache"], before, atol=0, rtol=0)


@requires_ort_kernels
def test_native_paged_attention_refuses_query_offsets_past_the_tokens_without_sequences():
    """No sequence, ``query_start_loc = [5]`` over 2 tokens: the offset is checked too (the
    kernel zeroes the output rows before the first offset)."""
    inputs, kwargs = _paged_inputs(AttentionCase("decode", (1, 1), (5, 16)))
    inputs["query"] = inputs["query"][:2]
    session = _attention_session(inputs, kwargs, "native")
    inputs |= {
        "block_tables": inputs["block_tables"][:0],
        "seq_lens": inputs["seq_lens"][:0],
        "query_start_loc": torch.tensor([5], dtype=torch.int32),
    }
    with pytest.raises(
        Exception, match=r"query_start_loc\[0\] = 5 is outside \[0, num_tokens = 2\]"
    ):
        session.run(inputs)


@requires_ort_kernels
@pytest.mark.parametrize("head_size", [8, 40, 160])
def test_native_paged_attention_pads_other_head_sizes(head_size):
    """Head sizes that are not a compiled row width run zero padded to the next one."""
    case = AttentionCase("mixed", (1, 9, 1), (4, 0, 3), head_size=head_size, sliding_window=5)
    _check_paged_attention(case, "native")


LONG_DECODE = AttentionCase("long-decode", (1, 1, 5, 1), (1000, 600, 20, 0), head_size=64)


@requires_ort_kernels
@pytest.mark.parametrize(
    "case",
    [
        LONG_DECODE,
        LONG_DECODE.with_(dtype=torch.bfloat16, alibi=True),
        LONG_DECODE.with_(dtype=torch.float16, logits_soft_cap=5.0),
        # a window of 300 keys: most of a long context's splits see no key at all
        LONG_DECODE.with_(sliding_window=300, head_size=40),
        LONG_DECODE.with_(num_heads=8, num_kv_heads=1, causal=False, block_size=8),
    ],
    ids=lambda c: c.id,
)
def test_native_paged_attention_splits_long_decode_contexts(case: AttentionCase):
    """Decode queries over hundreds of blocks: the native kernel splits each context across
    threads (a partial softmax per split, combined afterwards)."""
    _check_paged_attention(case, "native")


# Prompts and prefill chunks that span several tiles of query rows and several chunks of 128
# keys of the native kernel's tiled prefill (paged_prefill.cc), beside decode rows.
LONG_PREFILL = AttentionCase("long-prefill", (300, 1, 130), (0, 40, 0), head_size=64)


@requires_ort_kernels
@pytest.mark.parametrize(
    "case",
    [
        LONG_PREFILL,
        # SmolLM2's heads (groups of 3), prefill chunks over 260 and 129 cached keys
        AttentionCase("chunk-over-context", (200, 77, 1), (260, 129, 500), 9, 3, 64),
        # a window across chunk boundaries, ALiBi and soft-cap, a head size of 2.5 vectors
        LONG_PREFILL.with_(sliding_window=100, alibi=True, logits_soft_cap=5.0, head_size=40),
        # groups of 8 (6 tokens a tile on AVX2), a block size of 8
        AttentionCase("long-chunked", (150, 140), (100, 0), 16, 2, 128, block_size=8),
        AttentionCase("long-cross", (140, 5), (30, 200), 4, 4, 32, causal=False),
        AttentionCase("long-cross", (140, 5), (30, 200), causal=False, sliding_window=70),
        LONG_PREFILL.with_(dtype=torch.bfloat16, logits_soft_cap=30.0),
        LONG_PREFILL.with_(dtype=torch.float16, alibi=True),
    ],
    ids=lambda c: c.id,
)
def test_native_paged_attention_tiles_long_prefills(case: AttentionCase):
    """Prompts and prefill chunks of hundreds of tokens: the native kernel's tiled prefill."""
    _check_paged_attention(case, "native")


ROTARY_CASES = [
    ((1, 16, 64), torch.float32),
    ((9, 5, 80), torch.float32),
    ((300, 12, 128), torch.float32),  # past the native kernel's parallel threshold
    ((4, 3, 32), torch.float16),
    ((4, 3, 32), torch.bfloat16),
    ((0, 2, 16), torch.float32),
]


@pytest.mark.parametrize(
    "shape,dtype", ROTARY_CASES, ids=[f"{'x'.join(map(str, s))}-{d}" for s, d in ROTARY_CASES]
)
def test_rotary_embedding_matches_reference(shape, dtype, kernels: str):
    x, cos, sin = make_rotary_inputs(*shape, dtype=dtype)
    inputs = {"x": x, "cos": cos, "sin": sin}
    out = single_node_session("NeoxRotaryEmbedding", inputs, {"output": x}, kernels).run(inputs)
    assert out["output"].shape == x.shape and out["output"].dtype == dtype
    assert_close_to_reference(out["output"], reference.rotary_embedding(x, cos, sin))


@pytest.mark.parametrize("head_size", [1, 7])
def test_rotary_embedding_refuses_an_odd_head_size(head_size, kernels: str):
    """No halves to rotate: the body rotated misaligned ones (found by tests/fuzz)."""
    x, cos, sin = (t[..., :head_size].contiguous() for t in make_rotary_inputs(3, 2, 8))
    inputs = {"x": x, "cos": cos, "sin": sin}
    session = single_node_session("NeoxRotaryEmbedding", inputs, {"output": x}, kernels)
    with pytest.raises(RuntimeError, match=r"NeoxRotaryEmbedding_n_Gather|an even head_size"):
        session.run(inputs)


@requires_ort_kernels
@pytest.mark.parametrize(
    "change,message",
    [
        (lambda x, c, s: (x[..., :7], c[:, :7], s[:, :7]), "an even head_size"),
        (lambda x, c, s: (x, c[:-1], s[:-1]), "cos, sin: expected [3, 8]"),
    ],
    ids=["odd-head-size", "table-tokens"],
)
def test_native_rotary_embedding_refuses_bad_inputs(change, message):
    x, cos, sin = change(*make_rotary_inputs(3, 2, 8))
    inputs = {"x": x, "cos": cos, "sin": sin}
    session = single_node_session("NeoxRotaryEmbedding", inputs, {"output": x}, "native")
    with pytest.raises(Exception, match=re.escape(message)):
        session.run(inputs)


QKV_CASES = [
    ((1, 12, 4, 64), torch.float32),
    ((9, 4, 2, 80), torch.float32),
    ((300, 12, 4, 64), torch.float32),  # past the native kernel's parallel threshold
    ((4, 4, 2, 32), torch.float16),
    ((4, 4, 2, 32), torch.bfloat16),
    ((0, 2, 1, 16), torch.float32),
]


@pytest.mark.parametrize(
    "shape,dtype", QKV_CASES, ids=[f"{'x'.join(map(str, s))}-{d}" for s, d in QKV_CASES]
)
def test_qkv_rotary_embedding_matches_reference(shape, dtype, kernels: str):
    tokens, heads, kv_heads, head_size = shape
    _, cos, sin = make_rotary_inputs(tokens, 1, head_size, dtype=dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size).to(dtype)
    inputs = {"qkv": qkv, "cos": cos, "sin": sin}
    expected = reference.qkv_rotary_embedding(qkv, cos, sin, heads, kv_heads)
    names = ("query", "key", "value")
    geometry = {"num_heads": heads, "num_kv_heads": kv_heads, "head_size": head_size}
    outputs = {name: ref.to(dtype) for name, ref in zip(names, expected, strict=True)}
    session = single_node_session("NeoxQKVRotaryEmbedding", inputs, outputs, kernels, **geometry)
    out = session.run(inputs)
    for name, ref in zip(names, expected, strict=True):
        assert out[name].shape == ref.shape and out[name].dtype == dtype
        assert_close_to_reference(out[name], ref)


MLP_CASES = [
    ((1, 4096), torch.float32),
    ((9, 74), torch.float32),  # a row that is not a multiple of the kernel's 16 lanes
    ((300, 1024), torch.float32),  # past the native kernel's parallel threshold
    ((4, 64), torch.float16),
    ((4, 64), torch.bfloat16),
    ((0, 16), torch.float32),
    ((1, 5, 40), torch.float32),  # the batch-1 rows of a transformers model (the fusions')
]
_MLP_IDS = [f"{'x'.join(map(str, s))}-{d}" for s, d in MLP_CASES]


def _seeded(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape,dtype", MLP_CASES, ids=_MLP_IDS)
def test_silu_and_mul_matches_reference(shape, dtype, kernels: str):
    x = _seeded(*shape, dtype=dtype, seed=0) * 4
    half = x[..., : shape[-1] // 2]
    out = single_node_session("SiluAndMul", {"x": x}, {"output": half}, kernels).run({"x": x})
    assert out["output"].shape == half.shape and out["output"].dtype == dtype
    assert_close_to_reference(out["output"], reference.silu_and_mul(x))


@pytest.mark.parametrize("shape,dtype", MLP_CASES, ids=_MLP_IDS)
def test_fused_add_rms_norm_matches_torch_op(shape, dtype, kernels: str):
    """The sum bit for bit; the normalized output to the op dtype's tolerance (the mean's
    summation order differs)."""
    inputs = {
        "x": _seeded(*shape, dtype=dtype, seed=1),
        "residual": _seeded(*shape, dtype=dtype, seed=2),
        "weight": _seeded(shape[-1], dtype=dtype, seed=3),
    }
    outputs = {"output": inputs["x"], "total": inputs["x"]}
    session = single_node_session("FusedAddRMSNorm", inputs, outputs, kernels, epsilon=1e-5)
    out = session.run(inputs)
    normed, total = attnexport.fused_add_rms_norm(*inputs.values(), 1e-5)
    torch.testing.assert_close(out["total"], total, atol=0, rtol=0)
    assert_close_to_reference(out["output"], normed.double())


@requires_ort_kernels
def test_native_qkv_rotary_embedding_refuses_a_wrong_width():
    _, cos, sin = make_rotary_inputs(3, 1, 8)
    inputs = {"qkv": torch.ones(3, 40), "cos": cos, "sin": sin}
    outputs = {
        "query": torch.ones(3, 2, 8),
        "key": torch.ones(3, 1, 8),
        "value": torch.ones(3, 1, 8),
    }
    geometry = {"num_heads": 2, "num_kv_heads": 1, "head_size": 8}
    session = single_node_session("NeoxQKVRotaryEmbedding", inputs, outputs, "native", **geometry)
    with pytest.raises(Exception, match=re.escape("qkv: expected [num_tokens, 32]")):
        session.run(inputs)


@requires_ort_kernels
def test_native_mlp_kernels_refuse_bad_inputs():
    x = torch.ones(3, 5)
    session = single_node_session("SiluAndMul", {"x": x}, {"output": x}, "native")
    with pytest.raises(Exception, match=re.escape("expected [..., num_tokens, 2 * d] (an even")):
        session.run({"x": x})
    inputs = {"x": torch.ones(3, 8), "residual": torch.ones(3, 8), "weight": torch.ones(4)}
    outputs = {"output": inputs["x"], "total": inputs["x"]}
    session = single_node_session("FusedAddRMSNorm", inputs, outputs, "native", epsilon=1e-5)
    with pytest.raises(Exception, match=re.escape("weight: expected [8] ([hidden] of x), got [4]")):
        session.run(inputs)


def test_schemas_registered_first_leave_onnxscript_importable():
    """No attnexport node shares a name with a standard op: onnx.reference (imported by
    onnxscript) refuses two schemas of one name, so registering first broke the import."""
    code = (
        "from attnexport.lowering.registry import register_schemas\n"
        "register_schemas()\n"
        "import onnxscript, onnx.reference\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
