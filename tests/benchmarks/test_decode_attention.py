"""benchmarks/decode_attention.py runs end to end in quick mode (no timing asserts)."""

from __future__ import annotations

import json

from attnexport.custom_ops import get_backend
from tests.benchmark_scripts import load_benchmark


def test_quick_run_reports_every_implementation(capsys):
    assert load_benchmark("decode_attention").main(["--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["environment"]["dram_copy_gb_per_s"] > 0
    with_ipex = get_backend("ipex").unavailable_reason() is None
    expected = {"sdpa"} | ({"ipex", "ipex-backend", "ipex-raw"} if with_ipex else set())
    configs = {json.dumps(r["config"], sort_keys=True) for r in report["results"]}
    assert len(configs) >= 2
    for config in configs:
        rows = [r for r in report["results"] if json.dumps(r["config"], sort_keys=True) == config]
        assert {r["implementation"] for r in rows} == expected
        for r in rows:
            assert r["ms_per_call"] > 0 and r["kv_gb_per_s"] > 0 and r["tokens_per_s"] > 0
    assert len(report["ratios"]) == (len(configs) if with_ipex else 0)
