"""Every bad input is refused before a kernel runs, with the argument named."""

from __future__ import annotations

import pytest
import torch

import attnexport
from tests.attention_cases import AttentionCase, make_paged_inputs, make_varlen_inputs

CASE = AttentionCase("mixed", (1, 4, 1), (7, 0, 20), num_heads=4, num_kv_heads=2)


def _paged():
    x = make_paged_inputs(CASE)
    return {
        "query": x["query"],
        "key_cache": x["key_cache"],
        "value_cache": x["value_cache"],
        "block_tables": x["block_tables"],
        "seq_lens": x["seq_lens"],
        "query_start_loc": x["query_start_loc"],
        **x["kwargs"],
    }


def _write():
    x = make_paged_inputs(CASE)
    return {k: x[k] for k in ("key", "value", "key_cache", "value_cache", "slot_mapping")}


def _varlen():
    x = make_varlen_inputs(CASE)
    return {k: x[k] for k in ("query", "key", "value", "cu_seqlens_q", "cu_seqlens_k")} | x[
        "kwargs"
    ]


def _set(name, value):
    return lambda a: a.update({name: value(a) if callable(value) else value})


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


PAGED_ERRORS = {
    "int64 block_tables": (
        _set("block_tables", lambda a: a["block_tables"].long()),
        TypeError,
        "block_tables: expected dtype torch.int32, got torch.int64",
    ),
    "int64 seq_lens": (_set("seq_lens", lambda a: a["seq_lens"].long()), TypeError, "seq_lens"),
    "float query_start_loc": (
        _set("query_start_loc", lambda a: a["query_start_loc"].float()),
        TypeError,
        "query_start_loc: expected dtype torch.int32",
    ),
    "query/cache dtype": (
        _set("query", lambda a: a["query"].double()),
        TypeError,
        "key_cache: expected dtype torch.float64",
    ),
    "integer query": (_set("query", lambda a: a["query"].int()), TypeError, "query"),
    "query rank": (_set("query", lambda a: a["query"][0]), ValueError, "query: expected a 3-D"),
    "cache rank": (
        _set("key_cache", lambda a: a["key_cache"][0]),
        ValueError,
        "key_cache: expected a 4-D",
    ),
    "value cache shape": (
        _set("value_cache", lambda a: a["value_cache"][:-1]),
        ValueError,
        "value_cache: expected shape",
    ),
    "head size": (
        _set("query", lambda a: a["query"][..., :16].contiguous()),
        ValueError,
        "query: expected head_size 32",
    ),
    "heads not a multiple": (
        _set("query", lambda a: torch.cat([a["query"], a["query"][:, :1]], 1)),
        ValueError,
        "must be a multiple of the num_kv_heads",
    ),
    "block table rows": (
        _set("block_tables", lambda a: a["block_tables"][:2]),
        ValueError,
        "block_tables: expected 3 rows",
    ),
    "query_start_loc length": (
        _set("query_start_loc", _i32([0, 1, 6])),
        ValueError,
        "query_start_loc: expected shape [3 + 1]",
    ),
    "query_start_loc start": (
        _set("query_start_loc", _i32([1, 2, 6, 6])),
        ValueError,
        "query_start_loc[0] == 0",
    ),
    "query_start_loc not monotone": (
        _set("query_start_loc", _i32([0, 5, 2, 6])),
        ValueError,
        "non-decreasing",
    ),
    "query_start_loc total": (
        _set("query_start_loc", _i32([0, 1, 5, 5])),
        ValueError,
        "query_start_loc[-1] == 6",
    ),
    "seq_lens shorter than queries": (
        _set("seq_lens", _i32([8, 3, 21])),
        ValueError,
        "sequence 1 has 4 query tokens",
    ),
    "negative seq_lens": (_set("seq_lens", _i32([8, -1, 21])), ValueError, "non-negative"),
    "seq_lens beyond block table": (
        _set("seq_lens", _i32([8, 4, 200])),
        ValueError,
        "exceeds what block_tables covers",
    ),
    "block id out of range": (
        lambda a: a["block_tables"].__setitem__((2, 1), a["key_cache"].shape[0]),
        ValueError,
        "block_tables[2, 1]",
    ),
    "negative block id": (
        lambda a: a["block_tables"].__setitem__((0, 0), -1),
        ValueError,
        "expected a block id in [0,",
    ),
    "alibi shape": (
        _set("alibi_slopes", torch.ones(3)),
        ValueError,
        "alibi_slopes: expected shape [4]",
    ),
    "alibi dtype": (
        _set("alibi_slopes", torch.ones(4, dtype=torch.int32)),
        TypeError,
        "alibi_slopes",
    ),
    "sinks shape": (
        _set("sinks", torch.ones(4, 1)),
        ValueError,
        "sinks: expected a 1-D tensor [num_heads]",
    ),
    "sinks per head": (_set("sinks", torch.ones(3)), ValueError, "sinks: expected shape [4]"),
    "sinks dtype": (_set("sinks", torch.ones(4, dtype=torch.int32)), TypeError, "sinks"),
    "window zero": (_set("sliding_window", 0), ValueError, "sliding_window"),
    "negative soft cap": (_set("logits_soft_cap", -1.0), ValueError, "logits_soft_cap"),
    "nan scale": (_set("scale", float("nan")), ValueError, "scale: expected a finite float"),
}


@pytest.mark.parametrize("change,error,message", PAGED_ERRORS.values(), ids=PAGED_ERRORS.keys())
def test_paged_attention_rejects(change, error, message):
    args = _paged()
    change(args)
    with pytest.raises(error, match=_escape(message)):
        attnexport.paged_attention(**args)


WRITE_ERRORS = {
    "float slot_mapping": (
        _set("slot_mapping", lambda a: a["slot_mapping"].float()),
        TypeError,
        "slot_mapping: expected dtype torch.int32 or torch.int64",
    ),
    "slot out of range": (
        lambda a: a["slot_mapping"].__setitem__(0, a["key_cache"].shape[0] * 16),
        ValueError,
        "slot_mapping: slot",
    ),
    "duplicate slot": (
        lambda a: a["slot_mapping"].__setitem__(1, int(a["slot_mapping"][0])),
        ValueError,
        "distinct slots",
    ),
    "slot count": (
        _set("slot_mapping", lambda a: a["slot_mapping"][:-1]),
        ValueError,
        "slot_mapping: expected shape [6]",
    ),
    "key/cache dtype": (
        _set("key", lambda a: a["key"].half()),
        TypeError,
        "expected dtype torch.float16 (the dtype of key)",
    ),
    "key heads": (
        _set("key", lambda a: a["key"][:, :1]),
        ValueError,
        "key: expected [num_tokens, 2, 32]",
    ),
    "value shape": (_set("value", lambda a: a["value"][:-1]), ValueError, "value: expected shape"),
    "cache shapes": (
        _set("value_cache", lambda a: a["value_cache"][:, :8]),
        ValueError,
        "value_cache: expected shape",
    ),
}


@pytest.mark.parametrize("change,error,message", WRITE_ERRORS.values(), ids=WRITE_ERRORS.keys())
def test_reshape_and_cache_rejects(change, error, message):
    args = _write()
    before = args["key_cache"].clone()
    change(args)
    with pytest.raises(error, match=_escape(message)):
        attnexport.reshape_and_cache(**args)
    if args["key_cache"].shape == before.shape:
        assert torch.equal(args["key_cache"], before)  # nothing was written


VARLEN_ERRORS = {
    "int64 cu_seqlens": (
        _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long()),
        TypeError,
        "cu_seqlens_q: expected dtype torch.int32",
    ),
    "cu_seqlens lengths differ": (
        _set("cu_seqlens_k", lambda a: a["cu_seqlens_k"][:-1]),
        ValueError,
        "cu_seqlens_k: expected shape",
    ),
    "cu_seqlens_k total": (
        lambda a: a["cu_seqlens_k"].__setitem__(-1, 1000),
        ValueError,
        "cu_seqlens_k[-1] ==",
    ),
    "key/value shapes": (_set("value", lambda a: a["value"][:-1]), ValueError, "value: expected"),
    "key dtype": (_set("key", lambda a: a["key"].double()), TypeError, "key: expected dtype"),
}


@pytest.mark.parametrize("change,error,message", VARLEN_ERRORS.values(), ids=VARLEN_ERRORS.keys())
def test_varlen_attention_rejects(change, error, message):
    args = _varlen()
    change(args)
    with pytest.raises(error, match=_escape(message)):
        attnexport.varlen_attention(**args)


def test_revalidates_metadata_changed_in_place():
    """Validation results are kept only in a step plan: an in-place change is seen."""
    args = _paged()
    attnexport.paged_attention(**args)
    args["block_tables"][2, 1] = 10_000
    with pytest.raises(ValueError, match="block_tables"):
        attnexport.paged_attention(**args)


def test_padding_entries_beyond_a_sequence_are_not_checked():
    """Only the blocks a sequence uses must be valid; padding entries may hold anything."""
    args = _paged()
    args["block_tables"][:, -1] = -1
    attnexport.paged_attention(**args)


def _escape(message: str) -> str:
    import re

    return re.escape(message)
