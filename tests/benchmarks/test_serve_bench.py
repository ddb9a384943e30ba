"""benchmarks/serve.py: a leg whose server dies at startup is a RuntimeError quoting its log
(the benchmark records it and goes on with the other legs); it read the stderr of a process
whose stderr went to a file and crashed the whole run with an AttributeError."""

from __future__ import annotations

import argparse

import pytest

from tests.benchmark_scripts import load_benchmark


def test_a_server_that_exits_at_startup_is_a_runtime_error_naming_its_log(tmp_path):
    pytest.importorskip("httpx", reason="needs the serve extra")
    serve = load_benchmark("serve")
    args = argparse.Namespace(
        work=tmp_path, threads=1, max_num_seqs=4, kv_cache_gib=0.1, structured=False
    )
    with pytest.raises(RuntimeError, match=r"attnexport: the server exited \(.*attnexport\.log\)"):
        serve.start_leg("attnexport", args)  # no model in tmp_path: `serve` exits with 2
    assert "model.onnx" in (tmp_path / "attnexport.log").read_text()
