"""benchmarks/decode_attention.py runs end to end in quick mode (no timing asserts)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from attnexport.custom_ops import get_backend

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "decode_attention.py"


def _load():
    spec = importlib.util.spec_from_file_location("decode_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_quick_run_reports_every_implementation(capsys):
    assert _load().main(["--quick", "--json"]) == 0
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
