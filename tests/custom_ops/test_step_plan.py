"""Per-step plans: metadata rewritten between calls is always seen, plans are kept only inside an
explicit step plan, and every op runs under ``torch.inference_mode()``.

The IPEX cases run in a subprocess: before step plans, a stale IPEX plan wrote keys into another
sequence's blocks and then read an out-of-range block id (a segfault).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnexport
from attnexport.custom_ops import StepPlan, get_backend, step_plan, use_backend
from attnexport.custom_ops.planning import MISSING, current_step_plan, entry_key
from tests.attention_cases import AttentionCase, make_paged_inputs, make_rotary_inputs

ROOT = Path(__file__).resolve().parents[2]
CASE = AttentionCase("decode", (1, 1, 1), (30, 2, 17), num_heads=4, num_kv_heads=2)


def _available(name: str) -> bool:
    return get_backend(name).is_available()


BACKENDS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(not _available(name), reason=f"{name} is not available here"),
    )
    for name in ("sdpa", "ipex")
]


def _rewrite(tensor: torch.Tensor, values, how: str) -> None:
    """Writes ``values`` into ``tensor`` without bumping its version counter."""
    if how == "numpy":
        tensor.numpy()[...] = values
    else:
        tensor.data[...] = torch.as_tensor(values, dtype=tensor.dtype)


def rewritten_metadata_is_seen(backend: str, how: str) -> None:
    """Two calls with the same metadata tensors, rewritten in between through ``how``: the second
    call equals a call on fresh copies of the new values (and differs from the first)."""
    x = make_paged_inputs(CASE)
    key_cache, value_cache = x["key_cache"], x["value_cache"]
    tables, lens, starts = x["block_tables"], x["seq_lens"], x["query_start_loc"]
    slots = x["slot_mapping"]
    kwargs = x["kwargs"]
    with use_backend(backend):
        attnexport.reshape_and_cache(x["key"], x["value"], key_cache, value_cache, slots)
        first = attnexport.paged_attention(
            x["query"], key_cache, value_cache, tables, lens, starts, **kwargs
        )

        # The next step: sequences 0 and 2 swap their blocks, sequence 1 is shorter, and the
        # new tokens go to other slots (sequence 2's row, position 10).
        new_tables = tables[[2, 1, 0]].clone()
        new_lens = torch.tensor([18, 2, 11], dtype=torch.int32)
        new_slots = torch.tensor(
            [int(new_tables[i, p // 16]) * 16 + p % 16 for i, p in enumerate((17, 1, 10))]
        )
        expected_caches = (key_cache.clone(), value_cache.clone())
        attnexport.reshape_and_cache(x["key"], x["value"], *expected_caches, new_slots.clone())
        _rewrite(tables, new_tables, how)
        _rewrite(lens, new_lens, how)
        _rewrite(slots, new_slots, how)
        attnexport.reshape_and_cache(x["key"], x["value"], key_cache, value_cache, slots)
        assert torch.equal(key_cache, expected_caches[0]), "a stale slot plan wrote elsewhere"
        assert torch.equal(value_cache, expected_caches[1])
        second = attnexport.paged_attention(
            x["query"], key_cache, value_cache, tables, lens, starts, **kwargs
        )
        fresh = attnexport.paged_attention(
            x["query"], key_cache, value_cache, new_tables, new_lens, starts.clone(), **kwargs
        )
        assert torch.equal(second, fresh)
        assert not torch.equal(second, first)

        # Rewritten to an out-of-range block id and slot: refused by name, never read.
        _rewrite(tables, torch.full_like(tables, key_cache.shape[0] + 1000), how)
        with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
            attnexport.paged_attention(
                x["query"], key_cache, value_cache, tables, lens, starts, **kwargs
            )
        _rewrite(slots, torch.full_like(slots, 10**6), how)
        with pytest.raises(ValueError, match="slot_mapping: slot 1000000 is out of range"):
            attnexport.reshape_and_cache(x["key"], x["value"], key_cache, value_cache, slots)


@pytest.mark.parametrize("how", ["numpy", "data"])
def test_rewritten_metadata_is_seen_sdpa(how):
    rewritten_metadata_is_seen("sdpa", how)


@pytest.mark.skipif(not _available("ipex"), reason="ipex is not available here")
@pytest.mark.parametrize("how", ["numpy", "data"])
def test_rewritten_metadata_is_seen_ipex(how):
    code = (
        "from tests.custom_ops.test_step_plan import rewritten_metadata_is_seen; "
        f"rewritten_metadata_is_seen('ipex', {how!r})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


# --------------------------------------------------------------------------- the plan itself


def test_a_step_plan_keeps_entries_only_for_tensors_it_owns():
    x = make_paged_inputs(CASE)
    metadata = (x["block_tables"], x["seq_lens"], x["query_start_loc"])
    args = (x["query"], x["key_cache"], x["value_cache"], *metadata)
    with use_backend("sdpa"):
        with step_plan(metadata) as plan:
            first = attnexport.paged_attention(*args, **x["kwargs"])
            kept = len(plan)
            assert kept >= 2  # the validation summary and the sdpa plan
            assert torch.equal(attnexport.paged_attention(*args, **x["kwargs"]), first)
            assert len(plan) == kept  # the second layer found them
            copies = tuple(t.clone() for t in metadata)  # not the step's: checked, not kept
            attnexport.paged_attention(*args[:3], *copies, **x["kwargs"])
            assert len(plan) == kept
        assert current_step_plan() is None


def test_step_plan_put_refuses_tensors_it_does_not_own():
    owned, other = torch.zeros(2), torch.zeros(2)
    plan = StepPlan([owned, None])
    key = entry_key("k", (other,), ())
    plan.put(key, (other,), 1)
    assert plan.get(key) is MISSING
    plan.put(entry_key("k", (owned,), ()), (owned,), 2)
    assert plan.get(entry_key("k", (owned,), ())) == 2
    plan.adopt([other])
    assert plan.owns((owned, other))


def test_the_torch_executor_opens_one_plan_per_step(monkeypatch):
    from attnexport.models import load_model
    from attnexport.runtime import TorchExecutor
    from attnexport.runtime.executors import torch_executor
    from attnexport.runtime.model_input import pack_decoder_step
    from attnexport.runtime.torch_inputs import StepTensors

    model = load_model("llama")
    executor = TorchExecutor(model, backend="sdpa", block_size=4)
    executor.initialize_cache(8, 0)
    vocab = executor.vocab_size
    plans = []
    opened = torch_executor.step_plan

    def recording(tensors):
        context = opened(tensors)
        plans.append(context)
        return context

    monkeypatch.setattr(torch_executor, "step_plan", recording)
    step = pack_decoder_step([0], [5], [[1, 2]], [[3, 4, 5, 6, 7]], [1], 4)
    logits = executor.execute(step)
    assert len(plans) == 1 and logits.shape == (1, vocab)
    # Without a plan every layer validates in full, with the same result.
    executor.initialize_cache(8, 0)
    with use_backend("sdpa"), torch.no_grad():
        direct = model(*StepTensors(step).index_args(), executor.kv_caches)
    assert torch.equal(direct.float(), logits)


# --------------------------------------------------------------------------- inference mode


def _op_calls() -> dict:
    """Every op's arguments (fresh tensors each call, so they can be made inside the mode)."""
    case = AttentionCase("mixed", (1, 9, 1, 17, 1), (40, 0, 3, 12, 1))

    def paged():
        x = make_paged_inputs(case)
        names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens")
        return [x[k] for k in names] + [x["query_start_loc"]], x["kwargs"]

    def write():
        x = make_paged_inputs(case)
        names = ("key", "value", "key_cache", "value_cache", "slot_mapping")
        return [x[k] for k in names], {}

    def varlen():
        g = torch.Generator().manual_seed(1)
        q, k = torch.randn(12, 4, 32, generator=g), torch.randn(14, 2, 32, generator=g)
        cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
        cu_k = torch.tensor([0, 7, 14], dtype=torch.int32)
        return [q, k, k * 2, cu_q, cu_k], {"scale": 0.2, "causal": True}

    def rotary():
        x, cos, sin = make_rotary_inputs(6, 4, 32, torch.float32)
        return [x, cos, sin], {}

    def qkv():
        x, cos, sin = make_rotary_inputs(6, 8, 32, torch.float32)
        return [x.flatten(1), cos, sin, 4, 2], {}

    def norm():
        g = torch.Generator().manual_seed(2)
        x, r, w = (torch.randn(s, generator=g) for s in ((5, 16), (5, 16), (16,)))
        return [x, r, w, 1e-6], {}

    return {
        "reshape_and_cache": write,
        "reshape_and_cache_functional": write,
        "paged_attention": paged,
        "varlen_attention": varlen,
        "rotary_embedding": rotary,
        "qkv_rotary_embedding": qkv,
        "silu_and_mul": lambda: ([torch.randn(5, 16, generator=torch.Generator())], {}),
        "fused_add_rms_norm": norm,
    }


def _run(op: str, make) -> list[torch.Tensor]:
    args, kwargs = make()
    result = getattr(torch.ops.attnexport, op)(*args, **kwargs)
    if op == "reshape_and_cache":
        result = (args[2], args[3])  # the caches it wrote
    return [t.clone() for t in (result if isinstance(result, (tuple, list)) else (result,))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", list(_op_calls()))
def test_every_op_runs_under_inference_mode(op, backend):
    make = _op_calls()[op]
    with use_backend(backend):
        outside = _run(op, make)
        with torch.inference_mode():
            inside = _run(op, make)
            x = make_paged_inputs(CASE)  # and inside a step plan over inference tensors
            metadata = (x["block_tables"], x["seq_lens"], x["query_start_loc"])
            with step_plan(metadata):
                args = (x["query"], x["key_cache"], x["value_cache"], *metadata)
                planned = attnexport.paged_attention(*args, **x["kwargs"])
                assert torch.equal(attnexport.paged_attention(*args, **x["kwargs"]), planned)
    assert len(inside) == len(outside)
    for a, b in zip(inside, outside, strict=True):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- malformed metadata

_INT32 = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([-(2**31), -(2**31) + 1, -2, 2**31 - 1, 2**31 - 2, 2**30]),
)


@st.composite
def _malformed_paged(draw):
    """paged_attention / reshape_and_cache / varlen_attention arguments: a valid batch (4 blocks
    of 4 tokens), then a few entries overwritten with arbitrary (often extreme) values."""
    num_seqs = draw(st.integers(0, 3))
    causal = draw(st.booleans())
    query_lens = draw(st.lists(st.integers(0, 2), min_size=num_seqs, max_size=num_seqs))
    seq_lens = [q + draw(st.integers(0 if causal else -q, 6)) for q in query_lens]
    width = max([0, *(-(-n // 4) for n in seq_lens)]) + draw(st.integers(0, 1))
    tables = [[draw(st.integers(0, 3)) for _ in range(width)] for _ in range(num_seqs)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    slots = list(range(starts[-1]))
    fields = {"block_tables": tables, "seq_lens": seq_lens, "query_start_loc": starts}
    fields["slot_mapping"] = slots
    for _ in range(draw(st.integers(0, 2))):
        name = draw(st.sampled_from(sorted(fields)))
        flat = fields[name] if name != "block_tables" else [r for r in tables if r]
        if not flat:
            continue
        i = draw(st.integers(0, len(flat) - 1))
        if name == "block_tables":
            flat[i][draw(st.integers(0, len(flat[i]) - 1))] = draw(_INT32)
        else:
            extremes = [2**32 + 1, -(2**32) + 1] if name == "slot_mapping" else []
            flat[i] = draw(st.one_of(_INT32, st.sampled_from(extremes or [0])))
    if num_seqs == 3 and draw(st.booleans()):  # offsets whose int32 differences look monotone
        starts[1:3] = [2**31 - 1, -2]
    return {
        "block_tables": torch.tensor(tables, dtype=torch.int32).view(num_seqs, width),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "slot_mapping": torch.tensor(slots, dtype=torch.int64),
        "num_tokens": len(slots),
        "causal": causal,
        "window": draw(st.sampled_from([-1, 1, 3])),
    }


def malformed_metadata_is_named(backend: str, examples: int) -> None:
    """Every op either runs (finite outputs of the right shape) or raises a ValueError/TypeError
    naming an argument: never a bare IndexError/RuntimeError, never a crash."""

    @settings(max_examples=examples, deadline=None, database=None)
    @given(_malformed_paged())
    def check(case):
        g = torch.Generator().manual_seed(0)
        num_blocks, block_size, t = 4, 4, case["num_tokens"]
        key_cache = torch.randn(num_blocks, block_size, 2, 8, generator=g)
        value_cache = torch.randn(num_blocks, block_size, 2, 8, generator=g)
        query, key = torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g)
        metadata = [case["block_tables"], case["seq_lens"]]
        starts = case["query_start_loc"]
        calls = {
            "paged_attention": lambda: attnexport.paged_attention(
                query,
                key_cache,
                value_cache,
                *metadata,
                starts,
                scale=0.3,
                causal=case["causal"],
                sliding_window=case["window"],
            ),
            "reshape_and_cache": lambda: attnexport.reshape_and_cache(
                key, key, key_cache, value_cache, case["slot_mapping"]
            ),
            "varlen_attention": lambda: attnexport.varlen_attention(
                query, key, key, starts, starts, 0.3, case["causal"]
            ),
        }
        for name, call in calls.items():
            try:
                out = call()
            except (ValueError, TypeError) as error:
                assert ":" in str(error), f"{name}: unnamed error {error!r}"
                continue
            if out is not None:
                assert out.shape == query.shape and bool(out.isfinite().all()), name
        assert bool(key_cache.isfinite().all())

    with use_backend(backend):
        check()


def test_malformed_metadata_is_named_sdpa():
    malformed_metadata_is_named("sdpa", 300)


@pytest.mark.skipif(not _available("ipex"), reason="ipex is not available here")
def test_malformed_metadata_is_named_ipex():
    code = (
        "from tests.custom_ops.test_step_plan import malformed_metadata_is_named; "
        "malformed_metadata_is_named('ipex', 300)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]


WRAPPING = [0, 2**31 - 1, -2, 1]
"""Offsets whose int32 differences (2^31 - 1, 2^31 - 1 after wrapping, 3) all look valid."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_that_only_wrap_to_monotone_are_refused(backend):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 4, 2, 8, generator=g)
    query, key = torch.randn(1, 4, 8, generator=g), torch.randn(1, 2, 8, generator=g)
    starts = torch.tensor(WRAPPING, dtype=torch.int32)
    tables, lens = torch.zeros(3, 1, dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)
    with use_backend(backend):
        with pytest.raises(ValueError, match="query_start_loc: expected non-decreasing"):
            attnexport.paged_attention(query, cache, cache, tables, lens, starts, 0.3, False)
        with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing"):
            attnexport.varlen_attention(query, key, key, starts, starts, 0.3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_block_tables_without_causal_give_zeros(backend):
    """Cross-attention over empty encoder outputs: no block-table column at all."""
    g = torch.Generator().manual_seed(0)
    cache, query = torch.randn(4, 4, 2, 8, generator=g), torch.randn(3, 4, 8, generator=g)
    tables, lens = torch.zeros(2, 0, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    starts = torch.tensor([0, 1, 3], dtype=torch.int32)
    with use_backend(backend):
        out = attnexport.paged_attention(query, cache, cache, tables, lens, starts, 0.3, False)
    assert torch.equal(out, torch.zeros_like(query))
