"""benchmarks/generate.py measures time to first token and decode speed from one run: the hf
leg subtracted two separately timed ``generate`` calls and printed a negative tok/s when the
longer one happened to run faster."""

from __future__ import annotations

import argparse
import itertools
import math
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("generate")


@pytest.fixture(scope="module")
def hf_args(bench, tmp_path_factory):
    work = tmp_path_factory.mktemp("bench_generate")
    bench.make_checkpoint(work / "ckpt", quick=True)
    vocab = bench.QUICK_CONFIG["vocab_size"]
    return argparse.Namespace(work=work, batch=2, prompt_len=8, new_tokens=5, vocab=vocab)


def test_hf_leg_times_one_run(bench, hf_args, monkeypatch):
    """With a clock that ticks once per reading, every timed run lasts the same: decode time
    taken as the difference of two runs is 0 (a division by zero, or any sign on a real
    clock); taken within one run it is the ticks between the first and the last token."""
    ticks = itertools.count()
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    result = bench.leg_hf(hf_args)
    assert result["ttft_s"] == 1
    assert result["decode_tok_s"] == hf_args.batch * (hf_args.new_tokens - 1)


def test_hf_leg_on_the_real_clock_is_positive(bench, hf_args):
    result = bench.leg_hf(hf_args)
    assert result["ttft_s"] > 0
    assert 0 < result["decode_tok_s"] < math.inf


@given(
    start=st.floats(0, 1e6),
    to_first=st.floats(0, 1e3),
    to_end=st.floats(1e-6, 1e3),
    batch=st.integers(1, 64),
    new=st.integers(2, 4096),
)
def test_rates_are_positive_for_ordered_times(bench, start, to_first, to_end, batch, new):
    result = bench.rates(batch, new, start, start + to_first, start + to_first + to_end)
    assert result["ttft_s"] >= 0 and result["decode_tok_s"] > 0


def test_rates_refuse_times_out_of_order(bench):
    with pytest.raises(ValueError, match="out of order"):
        bench.rates(1, 8, 0.0, 2.0, 1.0)
    with pytest.raises(ValueError, match="at least 2"):
        bench.rates(1, 1, 0.0, 1.0, 2.0)


def test_a_peers_decode_rate_counts_only_the_tokens_after_the_last_first_token():
    """An engine that decodes the first sequences while others still prefill (OpenVINO's
    split-fuse at its default budget) has more tokens than the batch when the last sequence
    gets its first: those are not the decode window's. 4 sequences of 8 tokens, 10 out at the
    last first token (t = 1), the last token at t = 3: 22 tokens over 2 s, not 28."""
    peer_legs = load_benchmark("peer_legs")
    result = peer_legs.rates(4, 8, start=0.0, first=1.0, end=3.0, at_first=10)
    assert result["decode_tok_s"] == 11.0 and result["tokens_at_first_token"] == 10
    assert peer_legs.rates(4, 8, 0.0, 1.0, 3.0)["decode_tok_s"] == 14.0  # lockstep: 4 at first


def test_an_export_of_other_sources_or_flags_gets_another_stamp(tmp_path):
    """The SmolLM2 benchmark reuses an export of ours only when its stamp matches: one made
    before a change to attnexport's sources (or with other flags) is made again, not measured."""
    bench = load_benchmark("generate_smollm2")
    (tmp_path / "attnexport").mkdir()
    source = tmp_path / "attnexport" / "lowering.py"
    source.write_text("x = 1\n")
    before = bench.export_stamp(["--weights", "int4"], tmp_path)
    assert bench.export_stamp(["--weights", "int4"], tmp_path) == before
    assert bench.export_stamp(["--weights", "int8"], tmp_path) != before
    source.write_text("x = 2\n")
    assert bench.export_stamp(["--weights", "int4"], tmp_path) != before
