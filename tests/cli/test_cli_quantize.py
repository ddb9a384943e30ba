"""``attnexport export --weights int4|int8``: the manifest's ``weights`` object, ``inspect``
showing it, ``verify`` comparing with the float eager model by logit error, top-1 agreement
and KL divergence, ``run`` generating, and the flag errors."""

from __future__ import annotations

import json

import pytest

from attnexport.artifact import read_manifest
from attnexport.lowering.quantize import DEFAULTS
from tests.cli.helpers import assert_one_line_error, run_cli, run_json


@pytest.fixture(scope="module")
def int4_export(tmp_path_factory):
    from attnexport.cli.main import main

    out = tmp_path_factory.mktemp("llama_int4")
    argv = ["export", "llama", "--out", str(out), "--weights", "int4"]
    assert main([*argv, "--weights-keep-float", "model.layers.0.mlp.*"]) == 0
    return out


def test_manifest_records_the_quantization(int4_export):
    weights = read_manifest(int4_export)["weights"]
    assert weights == {
        "format": "int4",
        "bits": 4,
        **DEFAULTS["int4"],
        "batch_invariant": True,
        "quantized_layers": 7,
        "float_layers": ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"],
    }


def test_a_float_export_has_no_weights_entry(llama_export):
    assert "weights" not in read_manifest(llama_export)


def test_inspect_shows_the_quantization(int4_export, capsys):
    code, out, _ = run_cli(capsys, "inspect", int4_export, "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["weights"]["format"] == "int4"
    # 6 projections in 4 bits (layer 1's gate/up with its SiluAndMul), the int8 logits
    # projection; int16 activations, so no offsets.
    assert summary["nodes"]["attnexport::MatMul4Bits"] == 5
    assert summary["nodes"]["attnexport::MatMul4BitsSiluAndMul"] == 1
    assert "attnexport::SiluAndMul" in summary["nodes"]  # (layer 0's gate/up stayed float)
    assert summary["nodes"]["attnexport::MatMul8Bits"] == 1
    assert "com.microsoft::MatMulNBits" not in summary["nodes"]
    code, out, _ = run_cli(capsys, "inspect", int4_export)
    assert code == 0 and "weights: int4 (MatMul4Bits" in out and "int16 activations" in out
    assert "algorithm hqq" in out and "lm_head int8" in out and "batch-invariant" in out


def test_inspect_names_the_int8_kernel():
    """``--weights int8`` runs attnexport.MatMul8Bits: no accuracy level, no offsets."""
    from attnexport.cli.inspect_cmd import weights_line

    entry = {"format": "int8", "bits": 8, **DEFAULTS["int8"], "lm_head_block_size": 32}
    line = weights_line(entry | {"quantized_layers": 7, "float_layers": []})
    assert line.startswith("weights: int8 (MatMul8Bits, 8 bits, block size 32, asymmetric")
    assert "int16 activations" in line and "accuracy level" not in line and "offsets" not in line
    old = weights_line(entry | {"activations": "int8", "quantized_layers": 7})
    assert "(MatMulNBits," in old and "accuracy level 4" in old
    prefill = weights_line(entry | {"prefill_activations": "int8", "quantized_layers": 7})
    assert "int16 activations, int8 prefill activations" in prefill
    every = {"prefill_activations": "int8", "decode_activations": "int8", "quantized_layers": 7}
    line = weights_line(entry | every)
    assert "int8 activations in every call" in line and "int16" not in line


def test_verify_compares_with_the_float_model_by_quality(int4_export, capsys):
    code, out, err = run_cli(capsys, "verify", int4_export, "--json")
    assert code == 0, out + err
    result = json.loads(out)
    rows = [c for c in result["comparisons"] if c["leg"].startswith("onnx") and "bounds" in c]
    assert {c["leg"] for c in rows} >= {"onnx"}
    for row in rows:
        assert row["output"].startswith("logits (")
        assert set(row["bounds"]) == {"kl", "ppl_increase", "confident_flips"}
        assert 0 < row["kl"] <= row["bounds"]["kl"] and row["ok"]
        assert 0 <= row["top1_agreement"] <= 1 and row["max_abs"] > 1e-4
    code, out, _ = run_cli(capsys, "verify", int4_export)
    assert code == 0
    for column in ("logit err", "top-1", "KL", "ppl Δ", "flips", "bounds: KL <="):
        assert column in out


def test_run_generates_with_quantized_weights(int4_export, capsys):
    outputs = run_json(capsys, int4_export, "--prompt-ids", "5,17,99,3", "--max-tokens", "4")
    assert len(outputs[0]["token_ids"]) == 4


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--weights-block-size", "64"], "only with --weights int4 or int8"),
        (["--lm-head", "int8"], "only with --weights int4 or int8"),
        (["--weights", "int4", "--weights-algorithm", "hqq", "--weights-symmetric"], "asymmetric"),
        (["--weights", "int4", "--weights-block-size", "20"], "--weights-block-size"),
        (["--weights", "int8", "--format", "both"], "--format onnx"),
        (["--weights", "int4", "--weights-keep-float", "nothing.*"], "matches no layer"),
    ],
)
def test_flag_errors_are_named(tmp_path, capsys, flags, needle):
    code, _, err = run_cli(capsys, "export", "llama", "--out", tmp_path / "x", *flags)
    assert code != 0
    # The layer names come from the lowered graph: that error follows the progress lines.
    assert_one_line_error(err.strip().splitlines()[-1], "export", needle)
    assert not (tmp_path / "x" / "model.onnx").exists()


def test_a_malformed_weights_entry_is_named(int4_export, tmp_path):
    import shutil

    from attnexport.artifact import ArtifactError

    copy = tmp_path / "copy"
    shutil.copytree(int4_export, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["weights"] = "int4"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="field 'weights'"):
        read_manifest(copy)
