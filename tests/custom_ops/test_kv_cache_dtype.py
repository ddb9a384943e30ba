"""KV caches of a dtype of their own (float16, bfloat16, int8 with per-row scales) under
float activations: every backend against the float64 reference, the int8 formula to the bit,
the named refusals, opcheck and torch.export."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import attnexport
from attnexport.custom_ops import reference
from attnexport.custom_ops.kv_cache_dtype import dequantize_rows, quantize_rows
from attnexport.tolerances import cache_quantization_tolerance
from tests.attention_cases import (
    BATCHES,
    AttentionCase,
    cache_dtype_cases,
    cache_write_args,
    make_paged_inputs,
)
from tests.helpers import (
    assert_close_to_reference,
    attention_call,
    opcheck,
    paged_args,
    skip_unsupported,
)

CASES = cache_dtype_cases()


def _expected_caches(x: dict) -> tuple:
    copies = [None if t is None else t.clone() for t in cache_write_args(x)[2:]]
    args = cache_write_args(x)
    reference.reshape_and_cache(*args[:2], *copies[:2], args[4], *copies[3:])
    return copies


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cache_write_matches_reference_exactly(backend, case: AttentionCase):
    x = make_paged_inputs(case)
    expected = _expected_caches(x)
    with skip_unsupported():
        attnexport.reshape_and_cache(*cache_write_args(x))
    actual = cache_write_args(x)[2:]
    for got, want in zip(actual, expected, strict=True):
        if want is not None:
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_write_then_attend_matches_reference(backend, case: AttentionCase):
    x = make_paged_inputs(case)
    with skip_unsupported():
        attnexport.reshape_and_cache(*cache_write_args(x))
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    assert out.shape == x["query"].shape and out.dtype == case.dtype
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **x["kwargs"]))


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32], ids=lambda c: c.id)
def test_cache_dtype_error_is_within_its_tolerance(case: AttentionCase):
    """What the cache dtype costs: attention over the converted cache against the float64
    reference over the exact keys and values (the bound of tolerances.py, with its
    measurements)."""
    x = make_paged_inputs(case)
    exact = make_paged_inputs(case.with_(cache_dtype=None))
    attnexport.reshape_and_cache(*cache_write_args(x))
    out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    reference.reshape_and_cache(*cache_write_args(exact))
    expected = reference.paged_attention(*paged_args(exact), **exact["kwargs"])
    torch.testing.assert_close(
        out.double(), expected, **cache_quantization_tolerance(case.cache_dtype)
    )


def test_int8_rows_follow_the_formula_to_the_bit():
    rows = torch.tensor(
        [
            [1.0, -2.0, 0.5, 127.0],  # scale 1: exact integers, 0.5 rounds half to even (0)
            [0.0, 0.0, 0.0, 0.0],  # scale 0: all zeros
            [-3.0, 1.5, 2.5, 0.0],  # scale 3/127
            [2.54, -2.54, 1.27, 0.01],  # -amax -> -127, never -128
        ]
    )
    q, scale = quantize_rows(rows)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert q[0].tolist() == [1, -2, 0, 127] and scale[0] == 1.0
    assert q[1].tolist() == [0, 0, 0, 0] and scale[1] == 0.0
    expected_scale = torch.tensor(3.0) / 127.0
    assert scale[2] == expected_scale
    assert q[2].tolist() == torch.round(rows[2] / expected_scale).to(torch.int8).tolist()
    assert q[3, 1] == -127 and q[3, 0] == 127
    assert int(q.min()) >= -127
    torch.testing.assert_close(dequantize_rows(q, scale)[0], rows[0].clone().fill_(0) + q[0])


def test_half_precision_rows_round_to_nearest_even(backend):
    case = AttentionCase("mixed", *BATCHES["mixed"], cache_dtype=torch.bfloat16)
    x = make_paged_inputs(case)
    with skip_unsupported():
        attnexport.reshape_and_cache(*cache_write_args(x))
    slots = x["slot_mapping"].long()
    stored = x["key_cache"].view(-1, *x["key_cache"].shape[2:])[slots[slots >= 0]]
    assert torch.equal(stored, x["key"][slots >= 0].to(torch.bfloat16))


def _int8_inputs() -> dict:
    return make_paged_inputs(AttentionCase("mixed", *BATCHES["mixed"], cache_dtype=torch.int8))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"key_scale_cache": None}, ValueError, "key_scale_cache: required with int8 caches"),
        ({"value_scale_cache": None}, ValueError, "value_scale_cache: required with int8"),
        (
            {"key_scale_cache": lambda s: s[:, :-1]},
            ValueError,
            r"key_scale_cache: expected shape \(\d+, 16, 2\)",
        ),
        (
            {"value_scale_cache": lambda s: s.to(torch.float16)},
            TypeError,
            "value_scale_cache: expected dtype torch.float32",
        ),
        (
            {"value_scale_cache": lambda s: s[..., None]},
            ValueError,
            "value_scale_cache: expected a 3-D tensor",
        ),
        (
            {"value_cache": lambda c: c.to(torch.float32)},
            TypeError,
            "value_cache: expected dtype torch.int8",
        ),
    ],
)
def test_int8_caches_refuse_bad_scales(change, error, match):
    x = _int8_inputs()
    for name, new in change.items():
        x[name] = new(x[name]) if callable(new) else new
    scales = {"key_scale_cache": x["key_scale_cache"], "value_scale_cache": x["value_scale_cache"]}
    names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
    with pytest.raises(error, match=match):
        attnexport.reshape_and_cache(*(x[n] for n in names), **scales)
    kwargs = {**x["kwargs"], **scales}
    with pytest.raises(error, match=match):
        attnexport.paged_attention(*paged_args(x), **kwargs)


def test_float_caches_refuse_scale_caches():
    x = make_paged_inputs(AttentionCase("mixed", *BATCHES["mixed"], cache_dtype=torch.float16))
    scales = torch.zeros(x["key_cache"].shape[:3])
    with pytest.raises(ValueError, match=r"key_scale_cache: expected None with torch\.float16"):
        attnexport.reshape_and_cache(
            x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"], scales
        )
    with pytest.raises(ValueError, match=r"value_scale_cache: expected None with torch\.float16"):
        attnexport.paged_attention(*paged_args(x), **x["kwargs"], value_scale_cache=scales)


def test_integer_caches_other_than_int8_are_refused():
    x = make_paged_inputs(AttentionCase("mixed", *BATCHES["mixed"]))
    caches = (x["key_cache"].to(torch.int32), x["value_cache"].to(torch.int32))
    with pytest.raises(
        TypeError, match=r"key_cache: expected dtype .*torch\.int8, got torch\.int32"
    ):
        attnexport.reshape_and_cache(x["key"], x["value"], *caches, x["slot_mapping"])


def test_functional_write_returns_the_written_scale_caches(backend):
    x = _int8_inputs()
    before = [t.clone() for t in cache_write_args(x)[2:4]]
    scales_before = (x["key_scale_cache"].clone(), x["value_scale_cache"].clone())
    with skip_unsupported():
        written = torch.ops.attnexport.reshape_and_cache_functional(*cache_write_args(x))
    expected = _expected_caches(x)
    assert len(written) == 4
    for got, want in zip(written, [*expected[:2], *expected[3:]], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(x["key_cache"], before[0], atol=0, rtol=0)  # inputs untouched
    torch.testing.assert_close(x["key_scale_cache"], scales_before[0], atol=0, rtol=0)


def test_functional_write_without_scales_returns_the_two_caches():
    x = make_paged_inputs(AttentionCase("mixed", *BATCHES["mixed"], cache_dtype=torch.float16))
    written = torch.ops.attnexport.reshape_and_cache_functional(*cache_write_args(x))
    assert len(written) == 2 and written[0].dtype == torch.float16


OPCHECK_CASES = [
    AttentionCase("mixed", (1, 9, 1, 5), (40, 0, 3, 12), cache_dtype=torch.int8),
    AttentionCase(
        "mixed", (1, 9, 1, 5), (40, 0, 3, 12), cache_dtype=torch.bfloat16, padded_tokens=2
    ),
    AttentionCase("mixed", (1, 9, 1), (4, 0, 3), dtype=torch.float16, cache_dtype=torch.int8),
]


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.id)
def test_opcheck(case):
    x = make_paged_inputs(case)
    args = cache_write_args(x)
    opcheck("reshape_and_cache", args)
    opcheck("reshape_and_cache_functional", args)
    opcheck("paged_attention", paged_args(x), x["kwargs"])


class _Int8Layer(torch.nn.Module):
    def forward(self, query, key, value, caches, slot_mapping, tables, seq_lens, starts):
        key_cache, value_cache, key_scales, value_scales = caches
        attnexport.reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping, key_scales, value_scales
        )
        return attnexport.paged_attention(
            query,
            key_cache,
            value_cache,
            tables,
            seq_lens,
            starts,
            0.125,
            key_scale_cache=key_scales,
            value_scale_cache=value_scales,
        )


def _layer_inputs(query_lens, context_lens, seed):
    x = make_paged_inputs(
        AttentionCase("export", query_lens, context_lens, cache_dtype=torch.int8), seed=seed
    )
    caches = [x["key_cache"], x["value_cache"], x["key_scale_cache"], x["value_scale_cache"]]
    return (
        x["query"],
        x["key"],
        x["value"],
        caches,
        x["slot_mapping"],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
    )


def test_export_of_int8_caches_writes_scales_in_place():
    tokens, seqs = Dim("num_tokens", min=2), Dim("num_seqs", min=2)
    blocks, width = Dim("num_blocks", min=2), Dim("max_blocks_per_seq", min=2)
    dynamic = (
        {0: tokens},
        {0: tokens},
        {0: tokens},
        [{0: blocks}] * 4,
        {0: tokens},
        {0: seqs, 1: width},
        {0: seqs},
        {0: seqs + 1},
    )
    program = torch.export.export(
        _Int8Layer(), _layer_inputs((3, 1, 4), (5, 20, 0), 0), dynamic_shapes=dynamic
    )
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("attnexport.reshape_and_cache.default") == 1
    eager, exported = (
        _layer_inputs((1, 1, 2), (9, 30, 3), 1),
        _layer_inputs((1, 1, 2), (9, 30, 3), 1),
    )
    torch.testing.assert_close(program.module()(*exported), _Int8Layer()(*eager), atol=0, rtol=0)
    for got, want in zip(exported[3], eager[3], strict=True):  # caches and scales in place
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize("name", ["ipex", "xformers"])
def test_backends_without_other_cache_dtypes_say_why(name, cache_dtype):
    """IPEX 2.8 and xFormers run caches of the query's dtype only: their static capabilities
    refuse other cache dtypes with the reason (available or not here), and auto picks sdpa."""
    device_type = "cpu" if name == "ipex" else "cuda"
    call = attention_call(
        device_type=device_type, dtype=torch.float32, num_heads=4, cache_dtype=cache_dtype
    )
    backend = attnexport.custom_ops.get_backend(name)
    wanted = f"KV cache with float32 activations: {backend.capabilities.cache_dtype_reason}"
    reasons = backend.capabilities.reasons(call)
    assert any(wanted in r and str(cache_dtype).removeprefix("torch.") in r for r in reasons)
    assert backend.capabilities.reasons(call._replace(cache_dtype=torch.float32)) == []
    if call.device_type == "cpu":
        with attnexport.custom_ops.use_backend("auto"):
            assert attnexport.custom_ops.select_backend(call).name == "sdpa"
