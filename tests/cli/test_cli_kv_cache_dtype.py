"""``attnexport export --kv-cache-dtype``: the flag, the manifest, ``inspect`` and ``run``."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import run_cli, run_json


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    from attnexport.cli.main import main

    out = tmp_path_factory.mktemp("llama_kv_int8")
    argv = ["export", "llama", "--out", str(out), "--format", "both", "--kv-cache-dtype", "int8"]
    assert main(argv) == 0
    return out


def test_export_records_the_cache_dtype_and_inspect_shows_it(int8_export, capsys):
    manifest = json.loads((int8_export / "manifest.json").read_text())
    assert (manifest["dtype"], manifest["kv_cache_dtype"]) == ("float32", "int8")
    code, out, _ = run_cli(capsys, "inspect", str(int8_export), "--json")
    summary = json.loads(out)
    assert code == 0 and summary["kv_cache_dtype"] == "int8"
    assert len(summary["cache_ports"]) == 8  # 2 layers x (2 caches + 2 scale caches)
    code, out, _ = run_cli(capsys, "inspect", str(int8_export))
    assert code == 0 and "KV cache dtype: int8, with float32 scale caches" in out


def test_run_gives_the_same_tokens_on_onnxruntime_and_pt2(int8_export, capsys):
    ort = run_json(capsys, str(int8_export), "--prompt-ids", "1,2,3", "--executor", "ort")
    pt2 = run_json(capsys, str(int8_export), "--prompt-ids", "1,2,3", "--executor", "torch")
    assert ort[0]["token_ids"] == pt2[0]["token_ids"]


def test_an_unknown_cache_dtype_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli(capsys, "export", "llama", "--out", tmp_path, "--kv-cache-dtype", "int4")
    assert "--kv-cache-dtype" in capsys.readouterr().err
