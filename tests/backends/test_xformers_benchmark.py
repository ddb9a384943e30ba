"""benchmarks/xformers_attention.py parses its arguments everywhere and refuses to run without
CUDA with one clear line (the measurements themselves need a GPU: scripts/gpu_suite.sh)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.benchmark_scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "xformers_attention.py"


def test_help_runs_without_a_gpu():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    )
    for flag in ("--quick", "--json", "--batches", "--contexts", "--backends"):
        assert flag in out.stdout


def test_arguments():
    bench = load_benchmark("xformers_attention")
    args = bench.parse_args(["--batches", "1,128", "--contexts", "1024,16384", "--json"])
    assert args.batches == [1, 128] and args.contexts == [1024, 16384] and args.json
    assert args.backends == ["xformers", "sdpa"] and args.modes == ["decode", "prefill"]
    assert args.dtype == "bfloat16"
    quick = bench.parse_args(["--quick"])
    assert quick.batches == [1, 8] and quick.contexts == [1024, 4096] and quick.iters == 5
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "train"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the benchmark")
def test_refuses_to_run_without_cuda():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.startswith("error: this benchmark needs a CUDA GPU")
    assert "Traceback" not in out.stderr
