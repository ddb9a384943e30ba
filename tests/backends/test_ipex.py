"""The ipex backend: availability, parity with sdpa, the IPEX limits it works around, its
``attnexport_ipex`` ops under opcheck, torch.compile and torch.export, validation before any
IPEX kernel runs, and per-step metadata plans.

Tests that run IPEX kernels skip without intel_extension_for_pytorch; the rest run everywhere.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import attnexport
from attnexport.backends import ipex_plan
from attnexport.custom_ops import (
    BackendUnsupportedError,
    get_backend,
    reference,
    step_plan,
    use_backend,
)
from attnexport.custom_ops.alibi import alibi_slopes
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from tests.attention_cases import (
    AttentionCase,
    make_paged_inputs,
    make_varlen_inputs,
    standard_cases,
)
from tests.helpers import assert_close_to_reference, layer_args, paged_args

IPEX = get_backend("ipex")
UNAVAILABLE = IPEX.unavailable_reason()
needs_ipex = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"needs intel_extension_for_pytorch ({UNAVAILABLE})"
)
ops = torch.ops.attnexport_ipex


# --------------------------------------------------------------------------- availability


def test_importing_attnexport_does_not_import_ipex():
    code = (
        "import sys, attnexport\n"
        "from attnexport.custom_ops import get_backend\n"
        "get_backend('ipex')\n"
        "print('intel_extension_for_pytorch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_registered_above_sdpa_for_cpu():
    assert IPEX.priority > get_backend("sdpa").priority
    assert IPEX.capabilities.devices == frozenset({"cpu"})
    assert torch.float64 not in IPEX.capabilities.dtypes


@pytest.mark.skipif(UNAVAILABLE is None, reason="intel_extension_for_pytorch is installed")
def test_without_ipex_the_reason_is_reported_and_auto_falls_back():
    assert "intel_extension_for_pytorch" in UNAVAILABLE and "attnexport[ipex]" in UNAVAILABLE
    x = make_paged_inputs(AttentionCase("one", (1,), (5,)))
    with use_backend("ipex"), pytest.raises(BackendUnsupportedError, match="not installed"):
        attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    with use_backend("auto"):
        out = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **x["kwargs"]))
    with pytest.raises(ModuleNotFoundError, match=r"attnexport\[ipex\]"):  # valid inputs
        _write(_kernel_inputs())


def test_refuses_float64_and_non_contiguous_caches_with_reasons():
    x = make_paged_inputs(AttentionCase("mixed", (1, 3), (4, 2), dtype=torch.float64))
    with use_backend("ipex"), pytest.raises(BackendUnsupportedError, match=r"dtype=torch\.float64"):
        attnexport.paged_attention(*paged_args(x), **x["kwargs"])
    if UNAVAILABLE is None:
        x = make_paged_inputs(AttentionCase("mixed", (1, 3), (4, 2)))
        key_cache = x["key_cache"].transpose(0, 1).contiguous().transpose(0, 1)
        with use_backend("ipex"), pytest.raises(BackendUnsupportedError, match="non-contiguous"):
            attnexport.paged_attention(x["query"], key_cache, *paged_args(x)[2:], 0.1)


def test_backends_command_lists_ipex(capsys):
    from attnexport.cli.backends_cmd import backend_report
    from attnexport.cli.main import main

    entry = next(e for e in backend_report() if e["name"] == "ipex")
    assert entry["available"] == (UNAVAILABLE is None)
    assert entry["unavailable_reason"] == UNAVAILABLE
    assert entry["capabilities"]["devices"] == "cpu"
    assert entry["capabilities"]["ALiBi"] == "yes" and entry["notes"]
    assert main(["backends"]) == 0
    printed = capsys.readouterr().out
    assert "ipex" in printed
    if UNAVAILABLE is not None:
        assert "intel_extension_for_pytorch is not installed" in printed
        assert "attnexport[ipex]" in printed  # not eaten as rich markup


# --------------------------------------------------------------------------- parity


@needs_ipex
@pytest.mark.parametrize("case", standard_cases(), ids=lambda c: c.id)
def test_matches_sdpa(case: AttentionCase):
    x = make_paged_inputs(case)
    if case.sinks:  # IPEX's kernels have none: refused by name (auto takes sdpa)
        with use_backend("ipex"), pytest.raises(BackendUnsupportedError, match="attention sinks"):
            attnexport.paged_attention(*paged_args(x), **x["kwargs"])
        return
    v = make_varlen_inputs(case)
    varlen = (v["query"], v["key"], v["value"], v["cu_seqlens_q"], v["cu_seqlens_k"])
    outputs = {}
    for name in ("ipex", "sdpa"):
        with use_backend(name):
            paged = attnexport.paged_attention(*paged_args(x), **x["kwargs"])
            outputs[name] = (paged, attnexport.varlen_attention(*varlen, **v["kwargs"]))
    for ipex_out, sdpa_out in zip(outputs["ipex"], outputs["sdpa"], strict=True):
        assert_close_to_reference(ipex_out, sdpa_out.to(torch.float64))


def _forked(x: dict) -> dict:
    """Each sequence forked 5 times: consecutive rows share all blocks (parallel sampling)."""
    copies = 5
    x["query"] = x["query"].repeat_interleave(copies, 0)
    x["block_tables"] = x["block_tables"].repeat_interleave(copies, 0)
    x["seq_lens"] = x["seq_lens"].repeat_interleave(copies, 0)
    x["query_start_loc"] = torch.arange(x["query"].shape[0] + 1, dtype=torch.int32)
    return x


def _negative_logits(x: dict) -> dict:
    x["query"] = -x["query"].abs() - 2.0
    x["key_cache"] = x["key_cache"].abs()
    return x


LONG = AttentionCase("long", (1, 1, 1), (300, 700, 1500), num_heads=8, num_kv_heads=2)

# (id, case, change to the inputs, scale): each is a call IPEX's kernels get wrong or refuse
# when called naively; the backend must match the reference anyway.
LIMITS = [
    # IPEX's window skips whole 128-key partitions but still counts them in the softmax max.
    ("window-skips-partitions", LONG.with_(sliding_window=50), _negative_logits, 1.0),
    ("window-with-soft-cap", LONG.with_(sliding_window=40, logits_soft_cap=2.0), None, None),
    # With 4+ consecutive rows sharing a first block IPEX picks a beam kernel that raises.
    ("forked-sequences", LONG.with_(num_heads=32, num_kv_heads=8), _forked, None),
    ("negative-scale", AttentionCase("mixed", (1, 9, 1), (40, 0, 3)), None, -0.2),
    ("zero-scale", AttentionCase("mixed", (1, 9, 1), (40, 0, 3)), None, 0.0),
    # flash_attn_varlen_func refuses ALiBi and reads a window of 1 as no window.
    (
        "alibi-chunked-prefill",
        AttentionCase("c", (30, 1, 200), (40, 9, 300), alibi=True),
        None,
        None,
    ),
    ("window-1-prefill", AttentionCase("p", (9, 20), (0, 7), sliding_window=1), None, None),
    (
        "cross-window-alibi",
        AttentionCase("x", (7, 3), (9, 0), causal=False, alibi=True, sliding_window=3),
        None,
        None,
    ),
]


@needs_ipex
@pytest.mark.parametrize("name,case,change,scale", LIMITS, ids=[c[0] for c in LIMITS])
def test_ipex_limits_are_worked_around(name, case, change, scale):
    x = make_paged_inputs(case)
    if change is not None:
        x = change(x)
    kwargs = x["kwargs"] if scale is None else dict(x["kwargs"], scale=scale)
    with use_backend("ipex"):
        out = attnexport.paged_attention(*paged_args(x), **kwargs)
    assert_close_to_reference(out, reference.paged_attention(*paged_args(x), **kwargs))


@needs_ipex
def test_queries_in_any_layout_and_empty_cross_cache():
    case = AttentionCase("x", (3, 4, 1), (0, 6, 8), causal=False, num_heads=4, num_kv_heads=2)
    x = make_paged_inputs(case)
    seq_lens = torch.tensor([0, 10, 9], dtype=torch.int32)  # sequence 0 has no encoder keys
    args = (x["key_cache"], x["value_cache"], x["block_tables"], seq_lens, x["query_start_loc"])
    expected = reference.paged_attention(x["query"], *args, **x["kwargs"])
    for query in (x["query"], x["query"].transpose(0, 1).contiguous().transpose(0, 1)):
        with use_backend("ipex"):
            out = attnexport.paged_attention(query, *args, **x["kwargs"])
        assert_close_to_reference(out, expected)
        assert torch.count_nonzero(out[:3]) == 0


# --------------------------------------------------------------------------- attnexport_ipex ops


def _kernel_inputs(dtype=torch.float32) -> dict:
    """Valid inputs of the three attnexport_ipex ops for a small decode + prefill batch."""
    x = make_paged_inputs(AttentionCase("mixed", (1, 6), (20, 0), dtype=dtype))
    bt = x["block_tables"]
    return {
        "key": x["key"],
        "value": x["value"],
        "key_cache": x["key_cache"],
        "value_cache": x["value_cache"],
        "slots": x["slot_mapping"].to(torch.int32),
        "query": x["query"][:1].contiguous(),
        "out": torch.empty_like(x["query"][:1]),
        "block_tables": bt[:1].contiguous(),
        "context_lens": x["seq_lens"][:1].contiguous(),
        "flash_query": x["query"][1:].contiguous(),
        "flash_out": torch.empty_like(x["query"][1:]),
        "ipex_key_cache": x["key_cache"].transpose(1, 2).contiguous(),
        "ipex_value_cache": x["value_cache"].transpose(1, 2).contiguous(),
        "cu_q": torch.tensor([0, 6], dtype=torch.int32),
        "cu_k": torch.tensor([0, 6], dtype=torch.int32),
        "flash_tables": bt[1:].contiguous(),
    }


def _write(k, **changes):
    a = {**k, **changes}
    ops.reshape_and_cache(a["key"], a["value"], a["key_cache"], a["value_cache"], a["slots"])


def _decode(k, window=-1, cap=0.0, scale=0.1, alibi=None, max_len=None, **changes):
    a = {**k, **changes}
    ops.single_query_attention(
        a["out"],
        a["query"],
        a["key_cache"],
        a["value_cache"],
        a["block_tables"],
        a["context_lens"],
        int(a["context_lens"].max()) if max_len is None else max_len,
        scale,
        alibi,
        window,
        cap,
    )


def _flash(k, window=-1, max_k=6, **changes):
    a = {**k, **changes}
    ops.flash_attn_varlen(
        a["flash_out"],
        a["flash_query"],
        a["ipex_key_cache"],
        a["ipex_value_cache"],
        a["cu_q"],
        a["cu_k"],
        6,
        max_k,
        0.1,
        True,
        a["flash_tables"],
        window,
        0.0,
    )


def _int32(*values):
    return torch.tensor(values, dtype=torch.int32)


# (id, call, expected error, message fragment): every one is caught before IPEX runs (IPEX
# itself would segfault, write out of bounds or return garbage), so these run without IPEX too.
BAD_CALLS = [
    ("negative-slot", lambda k: _write(k, slots=k["slots"] * 0 - 1), ValueError, "padding"),
    ("slot-out-of-range", lambda k: _write(k, slots=k["slots"] + 10**6), ValueError, "[0, "),
    ("int64-slots", lambda k: _write(k, slots=k["slots"].long()), TypeError, "int32"),
    (
        "key-dtype",
        lambda k: _write(k, key=k["key"].bfloat16(), value=k["value"].bfloat16()),
        TypeError,
        "reinterpret",
    ),
    (
        "key-strides",
        lambda k: _write(k, key=k["key"].transpose(1, 2).contiguous().transpose(1, 2)),
        ValueError,
        "contiguous",
    ),
    ("window-and-soft-cap", lambda k: _decode(k, window=4, cap=2.0), ValueError, "refuses"),
    (
        "block-out-of-range",
        lambda k: _decode(k, block_tables=k["block_tables"] + 1000),
        ValueError,
        "block ids",
    ),
    ("empty-row", lambda k: _decode(k, context_lens=_int32(0)), ValueError, "at least one key"),
    ("max-len-too-small", lambda k: _decode(k, max_len=3), ValueError, "below the longest"),
    (
        "heads-not-adjacent",
        lambda k: _decode(k, query=torch.randn(1, 4, 64)[:, :, :32]),
        ValueError,
        "adjacent heads",
    ),
    ("non-positive-scale", lambda k: _decode(k, scale=-0.1), ValueError, "scale"),
    (
        "int64-block-tables",
        lambda k: _decode(k, block_tables=k["block_tables"].long()),
        TypeError,
        "int32",
    ),
    ("bf16-alibi", lambda k: _decode(k, alibi=alibi_slopes(4).bfloat16()), TypeError, "float32"),
    (
        "flash-strided-cache",
        lambda k: _flash(
            k,
            ipex_key_cache=k["key_cache"].transpose(1, 2),
            ipex_value_cache=k["value_cache"].transpose(1, 2),
        ),
        ValueError,
        "ignores strides",
    ),
    ("flash-window-1", lambda k: _flash(k, window=1), ValueError, ">= 2"),
    ("flash-cu-seqlens", lambda k: _flash(k, cu_q=_int32(0, 5)), ValueError, "cu_seqlens_q"),
    ("flash-max-seqlen-k", lambda k: _flash(k, max_k=2), ValueError, "below the longest"),
]


@pytest.mark.parametrize(
    "call,error,fragment", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_kernel_inputs_are_checked_before_ipex_runs(call, error, fragment):
    with pytest.raises(error, match=fragment.replace("[", r"\[")):
        call(_kernel_inputs())


@needs_ipex
def test_opcheck_on_ipex_ops():
    k = _kernel_inputs()
    samples = [
        (
            ops.reshape_and_cache,
            (k["key"], k["value"], k["key_cache"], k["value_cache"], k["slots"]),
        ),
        (
            ops.single_query_attention,
            (
                k["out"],
                k["query"],
                k["key_cache"],
                k["value_cache"],
                k["block_tables"],
                k["context_lens"],
                21,
                0.1,
                alibi_slopes(4),
                -1,
                2.0,
            ),
        ),
        (
            ops.flash_attn_varlen,
            (
                k["flash_out"],
                k["flash_query"],
                k["ipex_key_cache"],
                k["ipex_value_cache"],
                k["cu_q"],
                k["cu_k"],
                6,
                6,
                0.1,
                True,
                k["flash_tables"],
                3,
                0.0,
            ),
        ),
    ]
    for op, args in samples:
        torch.library.opcheck(op, args)


@needs_ipex
def test_compiled_read_write_read_sees_each_state():
    """Inductor must order reads around the cache writes (IPEX's own ops do not declare them)."""
    x = make_paged_inputs(AttentionCase("mixed", (1, 9, 1), (40, 0, 3), padded_tokens=2))
    slots32 = ipex_plan.plan_slots(x["slot_mapping"]).slots
    keep = ipex_plan.plan_slots(x["slot_mapping"]).keep

    def step(key, value, key_cache, value_cache, query, block_tables, seq_lens, query_start_loc):
        before = key_cache.sum(dim=(1, 2, 3))
        ops.reshape_and_cache(key[keep], value[keep], key_cache, value_cache, slots32)
        middle = key_cache.sum(dim=(1, 2, 3))
        attnexport.reshape_and_cache(-key, -value, key_cache, value_cache, x["slot_mapping"])
        after = key_cache.sum(dim=(1, 2, 3))
        out = attnexport.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.2
        )
        return before, middle, after, out

    args = (
        x["key"],
        x["value"],
        x["key_cache"],
        x["value_cache"],
        x["query"],
        x["block_tables"],
        x["seq_lens"],
        x["query_start_loc"],
    )
    eager_args = [a.clone() for a in args]
    compiled_args = [a.clone() for a in args]
    with use_backend("ipex"):
        expected = step(*eager_args)
        actual = torch.compile(step, backend="inductor", fullgraph=True)(*compiled_args)
    assert not torch.equal(expected[0], expected[1]) and not torch.equal(expected[1], expected[2])
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_args[2], eager_args[2], atol=0, rtol=0)


class _IpexDecodeLayer(torch.nn.Module):
    """Writes a token per sequence and decodes, through the attnexport_ipex ops directly."""

    def forward(self, query, key, value, key_cache, value_cache, slots, block_tables, lens):
        ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
        out = torch.empty_like(query)
        ops.single_query_attention(
            out, query, key_cache, value_cache, block_tables, lens, 64, 0.125, None, -1, 0.0
        )
        return out


@needs_ipex
def test_export_of_a_module_on_ipex_ops():
    from torch.export import Dim

    case = AttentionCase("decode", (1, 1, 1), (5, 30, 40), num_heads=8, num_kv_heads=2)

    def inputs(seed):
        x = make_paged_inputs(case, seed=seed)
        return (
            x["query"],
            x["key"],
            x["value"],
            x["key_cache"],
            x["value_cache"],
            x["slot_mapping"].to(torch.int32),
            x["block_tables"],
            x["seq_lens"],
        )

    seqs = Dim("num_seqs", min=2)
    dynamic = ({0: seqs}, {0: seqs}, {0: seqs}, None, None, {0: seqs}, {0: seqs}, {0: seqs})
    program = torch.export.export(_IpexDecodeLayer(), inputs(0), dynamic_shapes=dynamic)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "attnexport_ipex.reshape_and_cache.default" in targets
    assert "attnexport_ipex.single_query_attention.default" in targets

    exported_args, eager_args = list(inputs(1)), list(inputs(1))
    actual = program.module()(*exported_args)
    expected = _IpexDecodeLayer()(*eager_args)
    torch.testing.assert_close(actual, expected, atol=0, rtol=0)
    torch.testing.assert_close(exported_args[3], eager_args[3], atol=0, rtol=0)
    x = make_paged_inputs(case, seed=1)
    reference.reshape_and_cache(
        x["key"], x["value"], x["key_cache"], x["value_cache"], x["slot_mapping"]
    )
    assert_close_to_reference(actual, reference.paged_attention(*paged_args(x), 0.125))


@needs_ipex
def test_exported_attnexport_ops_run_on_ipex():
    class Layer(torch.nn.Module):
        def forward(self, query, key, value, key_cache, value_cache, slots, tables, lens, starts):
            attnexport.reshape_and_cache(key, value, key_cache, value_cache, slots)
            return attnexport.paged_attention(
                query, key_cache, value_cache, tables, lens, starts, 0.2, sliding_window=9
            )

    x = make_paged_inputs(AttentionCase("mixed", (1, 9, 1), (40, 0, 3)))
    args = layer_args(x)
    program = torch.export.export(Layer(), tuple(a.clone() for a in args))
    with use_backend("ipex"):
        actual = program.module()(*(a.clone() for a in args))
    with use_backend("sdpa"):
        expected = Layer()(*(a.clone() for a in args))
    assert_close_to_reference(actual, expected.to(torch.float64))


# --------------------------------------------------------------------------- plans


def test_slot_plan_converts_once_per_step():
    slots = torch.tensor([17, 3, -1, 40, -1], dtype=torch.int64)
    with step_plan((slots,)):
        plan = ipex_plan.plan_slots(slots)
        assert plan.slots.dtype == torch.int32 and plan.slots.tolist() == [17, 3, 40]
        assert plan.keep.tolist() == [0, 1, 3]
        assert ipex_plan.plan_slots(slots) is plan  # every later layer of the step reuses it
    slots[0] = 18  # a new step writes the metadata in place: the plan is rebuilt
    with step_plan((slots,)):
        replanned = ipex_plan.plan_slots(slots)
    assert replanned is not plan and replanned.slots.tolist() == [18, 3, 40]


def test_attention_plan_is_built_once_and_routes_tokens():
    case = AttentionCase("mixed", (1, 9, 1, 17, 0), (40, 0, 3, 12, 5))
    x = make_paged_inputs(case)
    call = PagedAttentionCall(*paged_args(x), **x["kwargs"])
    metadata = (x["block_tables"], x["seq_lens"], x["query_start_loc"])
    with step_plan(metadata):
        plan = ipex_plan.plan_attention(call)
        assert ipex_plan.plan_attention(call) is plan
    assert plan.rows.tokens.tolist() == [0, 10]  # the two decode tokens
    assert plan.flash.cu_seqlens_q.tolist() == [0, 9, 26]  # the two multi-token sequences
    assert plan.flash.cu_seqlens_k.tolist() == [0, 9, 38]
    assert all(t.dtype == torch.int32 for t in (plan.flash.block_tables, plan.flash.cu_seqlens_k))

    slopes = alibi_slopes(case.num_heads)
    alibi = ipex_plan.plan_attention(call._replace(alibi_slopes=slopes))  # no flash with ALiBi
    assert alibi.flash is None and alibi.rows.tokens is None  # every token is a row
    lens = torch.cat([chunk.context_lens for chunk in alibi.rows.chunks])
    # Query j of a sequence sees p + 1 keys, p its position: 41, then 1..9, then 4, ...
    assert lens[:11].tolist() == [41, *range(1, 10), 4]


def test_windowed_rows_list_only_visible_slots():
    case = AttentionCase("p", (4,), (6,), block_size=4, sliding_window=3)
    x = make_paged_inputs(case)
    call = PagedAttentionCall(
        *paged_args(x), 0.125, alibi_slopes=alibi_slopes(case.num_heads), sliding_window=3
    )
    plan = ipex_plan.plan_attention(call)  # ALiBi: rows, no flash
    (chunk,) = plan.rows.chunks
    assert plan.rows.per_token and chunk.context_lens.tolist() == [3, 3, 3, 3]
    blocks = x["block_tables"][0].tolist()
    slot = [blocks[k // 4] * 4 + k % 4 for k in range(10)]
    assert chunk.block_tables.tolist() == [slot[4:7], slot[5:8], slot[6:9], slot[7:10]]
