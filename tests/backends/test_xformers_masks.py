"""The xformers backend's masks and plans, on CPU, with the real xformers bias objects.

xFormers has no CPU kernels, but its biases materialize on CPU. These tests check that the
biases the backend builds from our tensors mean exactly docs/ops.md (against
``reference.visible_keys``), and run the backend's kernels end to end with only the xFormers
kernel call replaced by a float64 attention over the materialized bias (``_emulated_forward``),
for each operator route (Hopper, Ampere with and without a paged operator).
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip(
    "xformers.ops.fmha",
    reason="xformers is not installed in this environment (the .venv-ipex environment has it)",
)

from xformers.ops.fmha import cutlass, flash, flash3, triton_splitk

import attnexport
from attnexport.backends import xformers as xformers_backend
from attnexport.backends import xformers_choice as choice
from attnexport.backends import xformers_masks as masks
from attnexport.custom_ops import AttentionCall, reference
from attnexport.custom_ops import paged_attention as paged
from attnexport.custom_ops import varlen_attention as varlen
from attnexport.custom_ops.alibi import alibi_slopes
from attnexport.custom_ops.planning import MISSING, entry_key, step_plan
from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_varlen_inputs,
    standard_cases,
)
from tests.backends.test_xformers_dispatch import (
    AMPERE,
    AMPERE_FLASH_ATTN,
    HOPPER,
)
from tests.helpers import assert_close_to_reference, paged_args

PROFILES = {"hopper": HOPPER, "ampere": AMPERE, "ampere+flash_attn": AMPERE_FLASH_ATTN}
OP_NAMES = {
    flash3.FwOp: "fa3",
    flash3.FwOp_KVSplit: "fa3",
    flash.FwOp: "fa2",
    triton_splitk.FwOp: "triton_splitk",
    cutlass.FwOp: "cutlass",
}


def _expected_packed(query_lens, key_lens, causal, window) -> torch.Tensor:
    """[sum(q), sum(k)] visibility of packed sequences by the reference rule."""
    visible = torch.zeros(sum(query_lens), sum(key_lens), dtype=torch.bool)
    q0 = k0 = 0
    for q, k in zip(query_lens, key_lens, strict=True):
        positions = torch.arange(k - q, k)
        visible[q0 : q0 + q, k0 : k0 + k] = reference.visible_keys(positions, k, causal, window)
        q0, k0 = q0 + q, k0 + k
    return visible


def _expected_paged(query_lens, seq_lens, block_tables, block_size, causal, window, width):
    """[sum(q), width] visibility of packed queries over the physical cache slots."""
    visible = torch.zeros(sum(query_lens), width, dtype=torch.bool)
    q0 = 0
    for i, (q, n) in enumerate(zip(query_lens, seq_lens, strict=True)):
        positions = torch.arange(n - q, n)
        logical = reference.visible_keys(positions, n, causal, window)
        slots = [
            int(block_tables[i, k // block_size]) * block_size + k % block_size for k in range(n)
        ]
        visible[q0 : q0 + q, slots] = logical
        q0 += q
    return visible


def _visible(bias, shape) -> torch.Tensor:
    return bias.materialize(shape, dtype=torch.float32) == 0


def _spare_padding(x: dict) -> dict:
    """Points unused block-table entries at a block no sequence owns. Any padding value is valid
    for the op, but xformers' ``materialize`` (a debugging aid) writes the mask of every table
    entry, so padding that names a sequence's own block would hide its keys in the picture."""
    tables, lens = x["block_tables"], x["seq_lens"]
    block_size = x["key_cache"].shape[1]
    used = {
        int(b)
        for row, n in zip(tables, lens.tolist(), strict=True)
        for b in row[: -(-n // block_size)]
    }
    spare = min(set(range(x["key_cache"].shape[0])) - used)
    for row, n in zip(tables, lens.tolist(), strict=True):
        row[-(-n // block_size) :] = spare
    return x


@pytest.mark.parametrize("causal,window", [(True, -1), (True, 3), (False, -1)])
def test_block_diagonal_bias_matches_reference(causal, window):
    query_lens, key_lens = [3, 0, 1, 5, 4], [7, 2, 1, 5, 9]
    bias = masks.block_diagonal_bias(query_lens, key_lens, causal, window, "cpu")
    shape = (sum(query_lens), sum(key_lens))
    assert torch.equal(
        _visible(bias, shape), _expected_packed(query_lens, key_lens, causal, window)
    )
    assert bias.q_seqinfo.seqstart_py == [0, *itertools.accumulate(query_lens)]
    assert bias.k_seqinfo.seqstart_py == [0, *itertools.accumulate(key_lens)]


def test_block_diagonal_bias_refuses_non_causal_window():
    with pytest.raises(ValueError, match="sliding_window: no xformers block-diagonal mask"):
        masks.block_diagonal_bias([1], [2], False, 4, "cpu")


def test_varlen_plan_drops_queries_that_see_no_key():
    # causal: 6 queries over 3 keys -> the first 3 see nothing; a sequence without keys too.
    query_lens, key_lens = [6, 2, 3], [3, 0, 5]
    kind = xformers_backend.PlanKind(True, -1, False, torch.float16, 64)
    plan = xformers_backend.plan_varlen(query_lens, key_lens, kind, HOPPER, torch.device("cpu"))
    assert plan.query_lens == [3, 0, 3] and plan.op == "fa3"
    assert plan.keep.tolist() == [3, 4, 5, 8, 9, 10]
    assert torch.equal(_visible(plan.bias, (6, 8)), _expected_packed([3, 0, 3], key_lens, True, -1))
    kind = xformers_backend.PlanKind(False, -1, False, torch.float32, 64)
    non_causal = xformers_backend.plan_varlen(
        query_lens, key_lens, kind, HOPPER, torch.device("cpu")
    )
    assert non_causal.query_lens == [6, 0, 3] and non_causal.op == "cutlass"


@pytest.mark.parametrize(
    "case",
    [
        AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1)),
        AttentionCase("cross", (3, 1, 6), (5, 9, 0), causal=False),
        AttentionCase("decode", (1, 1, 1), (5, 16, 70), sliding_window=6, block_size=8),
    ],
    ids=lambda c: c.id,
)
def test_paged_bias_matches_reference(case):
    x = _spare_padding(make_paged_inputs(case))
    query_lens = list(case.query_lens)
    seq_lens = x["seq_lens"].tolist()
    tables = x["block_tables"]
    bias = masks.paged_bias(
        query_lens, seq_lens, tables, case.block_size, case.causal, case.sliding_window
    )
    expected_type = {
        (True, False): "PagedBlockDiagonalCausalWithOffsetPaddedKeysMask",
        (False, False): "PagedBlockDiagonalPaddedKeysMask",
        (True, True): "PagedBlockDiagonalCausalWithOffsetGappyKeysMask",
    }[(case.causal, case.sliding_window >= 0)]
    assert type(bias).__name__ == expected_type
    assert bias.block_tables is tables and bias.page_size == case.block_size
    row = tables.shape[1] * case.block_size
    visible = _visible(bias, (sum(query_lens), len(seq_lens) * row))
    expected = _expected_paged(
        query_lens,
        seq_lens,
        tables,
        case.block_size,
        case.causal,
        case.sliding_window,
        visible.shape[1],
    )
    assert torch.equal(visible, expected)


def test_paged_bias_refuses_window_over_several_queries():
    tables = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="one query per sequence"):
        masks.paged_bias([2], [5], tables, 4, True, 3)


def test_plans_from_attention_metadata():
    """A scheduler step (two decodes, a chunked prefill, a prompt) through the metadata
    builder: on Hopper one paged FA3 call with the right mask; on Ampere with 16-token blocks
    every key gathered from the cache in sequence order."""
    block_size = 16
    step = attnexport.build_attention_metadata(
        [
            attnexport.ScheduledSequence(20, 1, block_ids=[2, 7]),
            attnexport.ScheduledSequence(16, 8, block_ids=[4, 1]),
            attnexport.ScheduledSequence(0, 5, block_ids=[6]),
            attnexport.ScheduledSequence(3, 1, block_ids=[3]),
        ],  # block 0 stays unused: it is the tables' padding (see _spare_padding)
        block_size=block_size,
    )
    seq_lens, starts = step.seq_lens.tolist(), step.query_start_loc.tolist()
    query_lens = [b - a for a, b in itertools.pairwise(starts)]
    kind = xformers_backend.PlanKind(True, -1, False, torch.bfloat16, 64)
    args = (step.block_tables, seq_lens, starts, block_size, kind)

    plan = xformers_backend.plan_paged(*args, HOPPER)
    assert plan.covers_all and plan.gathered is None
    assert plan.paged.op == "fa3" and plan.paged.tokens is None
    bias = plan.paged.bias
    assert bias.k_seqinfo.seqlen_py == seq_lens and bias.q_seqinfo.seqstart_py == starts
    shape = (sum(query_lens), len(seq_lens) * step.block_tables.shape[1] * block_size)
    visible = _visible(bias, shape)
    expected = _expected_paged(
        query_lens, seq_lens, step.block_tables, block_size, True, -1, visible.shape[1]
    )
    assert torch.equal(visible, expected)

    gathered = xformers_backend.plan_paged(*args, AMPERE).gathered
    cache = torch.randn(8, block_size, 2, 64)
    keys = cache.view(-1, 2, 64).index_select(0, gathered.slots)
    expected_keys = torch.cat(
        [paged.gather_sequence(cache, step.block_tables[i], n) for i, n in enumerate(seq_lens)]
    )
    assert torch.equal(keys, expected_keys)
    assert gathered.tokens is None and gathered.varlen.op == "fa2"


@pytest.mark.parametrize("causal,window", [(True, -1), (True, 4), (False, -1)])
def test_alibi_bias_matches_reference(causal, window):
    num_queries, num_keys, heads = 5, 11, 4
    slopes = alibi_slopes(heads)
    bias = masks.alibi_bias(slopes, num_queries, num_keys, causal, window, torch.float64)
    assert bias.shape == (1, heads, num_queries, num_keys) and bias.stride(-2) % 8 == 0
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, heads, 16, generator=g) for n in (num_queries, num_keys, num_keys))
    logits = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * 0.25 + bias[0]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v.double())
    positions = torch.arange(num_keys - num_queries, num_keys)
    expected = reference.attend(q, k, v, positions, 0.25, causal, slopes, window, 0.0)
    torch.testing.assert_close(out, expected)
    half = masks.alibi_bias(slopes, num_queries, num_keys, causal, window, torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.stride(-2) % 8 == 0


# --------------------------------------------------------------------------- emulated kernels


def _emulated_forward(query, key, value, bias, scale, op, *, used):
    """float64 attention with xformers' own mask semantics (``bias.materialize``), standing in
    for ``memory_efficient_attention_forward`` where there is no GPU."""
    used.append(OP_NAMES[op])
    shape = query.shape
    q, k, v = (t[0].reshape(t.shape[1], -1, t.shape[-1]).double() for t in (query, key, value))
    if isinstance(bias, torch.Tensor):
        add = bias[0].double()
    elif hasattr(bias, "block_tables"):
        row = bias.block_tables.shape[1] * bias.page_size
        add = bias.materialize((q.shape[0], len(bias.k_seqinfo.seqlen_py) * row), torch.float64)
        k, v = k[: add.shape[-1]], v[: add.shape[-1]]
        add = add[None]
    else:
        add = bias.materialize((q.shape[0], k.shape[0]), torch.float64)[None]
    logits = scale * torch.einsum("qhd,khd->hqk", q, k) + add
    assert not torch.isinf(logits).all(-1).any(), "a query row sees no key"
    out = torch.einsum("hqk,khd->qhd", torch.softmax(logits, -1), v)
    return out.to(query.dtype).reshape(shape)


@pytest.fixture(params=list(PROFILES))
def emulated(request, monkeypatch):
    """A fresh backend whose xFormers calls are emulated on a named GPU profile; yields the
    list of operators it used."""
    used: list[str] = []
    facts = PROFILES[request.param]
    monkeypatch.setattr(
        xformers_backend,
        "_forward",
        lambda *args: _emulated_forward(*args, used=used),
    )
    monkeypatch.setattr(xformers_backend, "_facts", lambda device: facts)
    return xformers_backend.XformersBackend(), facts, used


def _skip_refused(op: str, case: AttentionCase, summary, facts) -> None:
    call = AttentionCall(
        op=op,
        device_type="cuda",
        dtype=case.dtype,
        num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        block_size=case.block_size if op == "paged_attention" else None,
        causal=case.causal,
        alibi=case.alibi,
        sliding_window=case.sliding_window >= 0,
        soft_cap=case.logits_soft_cap > 0,
        sinks=case.sinks and op == "paged_attention",
        decode_only=summary.decode_only,
        chunked_prefill=summary.has_context,
    )
    backend = xformers_backend.XformersBackend()
    reasons = backend.capabilities.reasons(call) + choice.call_reasons(call, facts)
    if reasons:
        pytest.skip("; ".join(reasons))


# The standard matrix is mostly float32, which no paged operator takes: add half copies so that
# every paged route (FA3, triton split-K, FA2 over the cache; gathered keys) is exercised.
PAGED_CASES = [
    *standard_cases(),
    *(c.with_(dtype=torch.float16) for c in standard_cases() if c.dtype == torch.float32),
    # FA2 from flash_attn reads 256-token blocks; triton split-K takes equal query counts <= 16.
    AttentionCase("mixed", (1, 9, 1, 17), (300, 0, 3, 12), block_size=256, dtype=torch.float16),
    AttentionCase("spec", (4, 4, 4), (60, 3, 130), block_size=64, dtype=torch.bfloat16),
]


def _expected_ops(case: AttentionCase, x: dict, facts) -> set[str]:
    lens = [q for q, n in zip(case.query_lens, x["seq_lens"].tolist(), strict=True) if q and n]
    route = choice.route_paged(
        lens,
        case.dtype,
        case.head_size,
        case.block_size,
        case.causal,
        case.sliding_window >= 0,
        case.alibi,
        facts,
    )
    ops = {route.paged_op} if route.paged_rows else set()
    return ops | ({route.gather_op} if route.gather_rows else set())


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.id)
def test_paged_attention_emulated(emulated, case):
    backend, facts, used = emulated
    x = _spare_padding(make_paged_inputs(case))
    args = paged_args(x)
    _skip_refused(
        "paged_attention", case, paged.check(paged.PagedAttentionCall(*args, **x["kwargs"])), facts
    )
    kwargs = x["kwargs"]
    out = backend.paged_attention(paged.PagedAttentionCall(*args, **kwargs))
    assert out.dtype == case.dtype and out.shape == x["query"].shape
    assert_close_to_reference(out, reference.paged_attention(*args, **kwargs))
    assert set(used) == _expected_ops(case, x, facts)


@pytest.mark.parametrize("case", standard_cases(), ids=lambda c: c.id)
def test_varlen_attention_emulated(emulated, case):
    backend, facts, used = emulated
    x = make_varlen_inputs(case)
    args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
    kwargs = x["kwargs"]
    _skip_refused(
        "varlen_attention", case, varlen.check(varlen.VarlenAttentionCall(*args, **kwargs)), facts
    )
    out = backend.varlen_attention(varlen.VarlenAttentionCall(*args, **kwargs))
    assert_close_to_reference(out, reference.varlen_attention(*args, **kwargs))
    expected_op = choice.varlen_op(case.dtype, case.head_size, case.alibi, facts)
    assert set(used) == {expected_op}


def test_cross_attention_with_more_queries_than_keys_emulated(emulated):
    backend, _, _ = emulated
    for causal in (False, True):
        x = make_varlen_inputs(AttentionCase("cross", (6, 2), (-3, 3), causal=causal))
        args = (x["query"], x["key"], x["value"], x["cu_seqlens_q"], x["cu_seqlens_k"])
        out = backend.varlen_attention(varlen.VarlenAttentionCall(*args, 0.2, causal))
        kwargs = x["kwargs"] | {"scale": 0.2}
        assert_close_to_reference(out, reference.varlen_attention(*args, **kwargs))
        if causal:
            assert torch.count_nonzero(out[:3]) == 0


def test_plans_are_reused_across_layers(emulated):
    backend, _, _ = emulated
    case = AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1), dtype=torch.bfloat16)
    x = make_paged_inputs(case)
    metadata = (x["block_tables"], x["seq_lens"], x["query_start_loc"])
    args = [x[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens")]
    args += [x["query_start_loc"], 0.2, True, None, -1, 0.0]
    kind = xformers_backend.PlanKind(True, -1, False, torch.bfloat16, 32)
    key = entry_key("xformers-paged", metadata, (kind, 16))
    with step_plan(metadata) as step:
        first = backend.paged_attention(paged.PagedAttentionCall(*args))
        plan = step.get(key)
        assert plan is not MISSING
        assert torch.equal(backend.paged_attention(paged.PagedAttentionCall(*args)), first)
        assert step.get(key) is plan
