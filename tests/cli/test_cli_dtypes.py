"""Every dtype that exports, runs: bfloat16 ONNX (which onnxruntime's CPU provider cannot run)
is refused at export with the reason and the alternatives; float16 ONNX and bfloat16 .pt2
export and generate."""

from __future__ import annotations

import json

import pytest

from attnexport.cli.main import main


def test_bfloat16_onnx_is_refused_at_export_with_the_alternative(tmp_path, capsys):
    out = tmp_path / "bf16"
    for fmt in ("onnx", "both"):
        assert (
            main(["export", "llama", "--out", str(out), "--dtype", "bfloat16", "--format", fmt])
            == 2
        )
        err = capsys.readouterr().err
        assert "--dtype bfloat16" in err and "no bfloat16 kernels" in err
        assert "--dtype float32" in err and "--format pt2" in err
        assert not (out / "model.onnx").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "dtype,fmt", [("float16", "onnx"), ("bfloat16", "pt2"), ("float16", "pt2")]
)
def test_every_dtype_that_exports_runs(dtype, fmt, tmp_path, capsys):
    out = tmp_path / dtype
    assert main(["export", "llama", "--out", str(out), "--dtype", dtype, "--format", fmt]) == 0
    capsys.readouterr()
    argv = ["run", str(out), "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    (output,) = json.loads(capsys.readouterr().out)["outputs"]
    assert len(output["token_ids"]) == 4 and output["finish_reason"] == "length"
