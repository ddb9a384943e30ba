"""benchmarks/prefill.py's report: per-round ratios to transformers' leg, and a prompt whose
legs disagree on the greedy token is flagged (the legs run the same float32 model)."""

from __future__ import annotations

import argparse

from tests.benchmark_scripts import load_benchmark


def test_report_pairs_rounds_and_flags_disagreeing_tokens():
    bench = load_benchmark("prefill")
    times = {
        "ort-native": {128: [1.0, 3.0], 4096: [8.0, 9.0]},
        "hf": {128: [2.0, 2.0], 4096: [10.0, 9.0]},
    }
    results = {
        "legs": ["ort-native", "hf"],
        "ttft": times,
        "cpu": times,
        "tokens": {128: {"ort-native": 5, "hf": 5}, 4096: {"ort-native": 5, "hf": 6}},
        "fairness": {"alone": [], "reserve": [], "none": []},
    }
    text = bench.report(results, argparse.Namespace(lengths=[128, 4096]))
    rows = [line for line in text.splitlines() if line.startswith("| 128 ")]
    # Round ratios 0.5 and 1.5: best 0.50, median 1.00 (not the ratio of the medians).
    assert rows[0] == "| 128 | 1.000 / 2.000 | 2.000 / 2.000 | 0.50 / 1.00 | yes |"
    assert "| 4096 | 8.000 / 8.500 | 9.000 / 9.500 | 0.80 / 0.90 | NO |" in text
