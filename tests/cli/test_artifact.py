"""Clean artifacts: re-exporting into a used directory, manifest integrity (sizes and SHA-256),
only listed model files loaded, damaged files as one-line errors with exit code 2, and the
zoo-name vs checkpoint-directory ambiguity."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from attnexport.artifact import ArtifactError, read_manifest, resolve_artifact, write_manifest
from attnexport.cli.main import main
from attnexport.runtime import Engine
from tests.cli.helpers import assert_one_line_error, run_cli


@pytest.fixture
def export_copy(llama_export, tmp_path) -> Path:
    directory = tmp_path / "export"
    shutil.copytree(llama_export, directory)
    return directory


# ----------------------------------------------------------------------------- re-export


def test_export_into_an_earlier_export_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "llama", "--out", str(out), "--format", "both"]) == 0
    capsys.readouterr()
    code, _, err = run_cli(capsys, "export", "llama", "--out", out, "--format", "pt2")
    assert code == 2
    assert_one_line_error(err, "export", str(out), "--overwrite")
    assert (out / "model.onnx").is_file()  # nothing was touched

    code, _, _ = run_cli(capsys, "export", "llama", "--out", out, "--format", "pt2", "--overwrite")
    assert code == 0
    assert not (out / "model.onnx").exists()  # the earlier export's file is gone
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"] == {"pt2": "model.pt2"} and set(manifest["file_digests"]) == {
        "model.pt2"
    }


def test_overwrite_removes_the_earlier_tokenizer_files(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "llama", "--out", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["tokenizer_files"] = ["tokenizer.json"]  # as a checkpoint export records them
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "tokenizer.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    assert main(["export", "llama", "--out", str(out), "--overwrite"]) == 0
    assert not (out / "tokenizer.json").exists()
    assert (out / "notes.txt").read_text() == "mine"  # not the export's: kept


# ----------------------------------------------------------------------------- integrity


def test_manifest_records_size_and_sha256(llama_export):
    import hashlib

    manifest = json.loads((llama_export / "manifest.json").read_text())
    assert manifest["format_version"] == 2
    for name in ("model.onnx", "model.pt2"):
        data = (llama_export / name).read_bytes()
        assert manifest["file_digests"][name] == {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }


def test_the_writer_refuses_a_manifest_the_loaders_would_refuse(llama_export, tmp_path):
    """``write_manifest`` validates as ``read_manifest`` does: an export never leaves behind a
    manifest that every later command refuses; the valid one round-trips."""
    manifest = read_manifest(llama_export)
    with pytest.raises(ArtifactError, match="field 'cache'"):
        write_manifest(tmp_path, {**manifest, "cache": None})
    assert not (tmp_path / "manifest.json").exists()
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path) == manifest


def test_a_swapped_model_onnx_is_a_named_error(export_copy, tmp_path, capsys):
    assert main(["export", "llama", "--seed", "7", "--out", str(tmp_path / "other")]) == 0
    shutil.copy(tmp_path / "other" / "model.onnx", export_copy / "model.onnx")
    capsys.readouterr()
    for argv in (
        ("run", export_copy, "--prompt-ids", "1,2"),
        ("run", export_copy / "model.onnx", "--prompt-ids", "1,2"),
        ("verify", export_copy),
        ("inspect", export_copy),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, (argv, err)
        assert_one_line_error(err, argv[0], str(export_copy / "model.onnx"), "SHA-256")
    with pytest.raises(ArtifactError, match="SHA-256"):
        Engine.from_path(export_copy)


@pytest.mark.parametrize("name", ["model.onnx", "model.pt2"])
def test_a_truncated_model_file_is_a_named_error(name, export_copy, capsys):
    (export_copy / name).write_bytes((export_copy / name).read_bytes()[:1000])
    executor = "ort" if name.endswith("onnx") else "torch"
    code, _, err = run_cli(capsys, "run", export_copy, "--prompt-ids", "1", "--executor", executor)
    assert code == 2
    assert_one_line_error(err, "run", str(export_copy / name))


@pytest.mark.parametrize("name", ["model.onnx", "model.pt2"])
def test_a_corrupt_model_file_without_manifest_is_a_named_error(name, export_copy, capsys):
    """No manifest to check against (the file named directly): the parser's failure is
    reported as the file's."""
    (export_copy / "manifest.json").unlink()
    (export_copy / name).write_bytes(b"\x00not a model\x00" * 50)
    code, _, err = run_cli(capsys, "run", export_copy / name, "--prompt-ids", "1")
    assert code == 2
    assert_one_line_error(err, "run", str(export_copy / name))
    if name == "model.onnx":
        code, _, err = run_cli(capsys, "inspect", export_copy / name)
        assert code == 2
        assert_one_line_error(err, "inspect", str(export_copy / name))


@pytest.mark.parametrize(
    "text,field",
    [
        ("{not json", "not valid JSON"),
        ('{"format": "attnexport-artifact"}', "format_version"),
        ("[1, 2]", "not an attnexport manifest"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper"),  # was a RecursionError, exit 1
    ],
    ids=["not-json", "no-version", "not-an-object", "nested"],
)
def test_a_bad_manifest_is_a_named_error(text, field, export_copy, capsys):
    (export_copy / "manifest.json").write_text(text)
    for argv in (("run", export_copy, "--prompt-ids", "1"), ("verify", export_copy)):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2
        assert_one_line_error(err, argv[0], str(export_copy / "manifest.json"), field)


def test_a_bad_manifest_field_is_named(export_copy, capsys):
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["files"] = {"onnx": "../elsewhere/model.onnx"}
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    code, _, err = run_cli(capsys, "run", export_copy, "--prompt-ids", "1")
    assert code == 2
    assert_one_line_error(err, "run", "manifest.json", "'files'")


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"eos_token_ids": [2, 256]}, "generation.eos_token_ids"),  # the vocabulary is 256
        ({"eos_token_ids": 2}, "generation.eos_token_ids"),
        ({"eos_token_ids": ["2"]}, "generation.eos_token_ids"),
        ({"forced_bos_token_id": 10**9}, "generation.forced_bos_token_id"),
        ({"forced_eos_token_id": -1}, "generation.forced_eos_token_id"),
        ({"decoder_start_token_id": True}, "generation.decoder_start_token_id"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_generation_defaults_are_checked_at_load(changes, field, export_copy, capsys):
    """Every request takes them: a bad one started the server, then refused every request."""
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["generation"].update(changes)
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=re.escape(field)):
        read_manifest(export_copy)  # what run, serve, verify and embed read first
    code, _, err = run_cli(capsys, "run", export_copy, "--prompt-ids", "1", "--max-tokens", 1)
    assert code == 2
    assert_one_line_error(err, "run", str(export_copy / "manifest.json"), field)


def test_tokenizer_files_must_be_tokenizer_file_names(export_copy):
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["tokenizer_files"] = ["../../etc/passwd"]
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="field 'tokenizer_files'"):
        read_manifest(export_copy)


def test_an_empty_model_file_is_a_named_error(export_copy, tmp_path, capsys):
    """Even with a manifest whose digest says so (onnxruntime: "no graph", exit 1)."""
    (export_copy / "model.onnx").write_bytes(b"")
    manifest = json.loads((export_copy / "manifest.json").read_text())
    manifest["file_digests"]["model.onnx"] = {"bytes": 0, "sha256": hashlib.sha256().hexdigest()}
    (export_copy / "manifest.json").write_text(json.dumps(manifest))
    bare = tmp_path / "bare" / "model.onnx"
    bare.parent.mkdir()
    bare.write_bytes(b"")
    for argv in (
        ("run", export_copy, "--prompt-ids", "1"),
        ("run", export_copy / "model.onnx", "--prompt-ids", "1"),
        ("run", bare, "--prompt-ids", "1"),
        ("verify", export_copy),
        ("inspect", export_copy),
        ("inspect", bare),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert_one_line_error(err, argv[0], "model.onnx: empty (0 bytes)")


def test_an_onnx_file_without_a_graph_is_a_named_error(tmp_path, capsys):
    """onnxruntime's InvalidArgument about the file (it was an internal error, exit 1)."""
    bare = tmp_path / "model.onnx"
    bare.write_bytes(b"\x08\x07")  # a ModelProto with an IR version and nothing else
    code, _, err = run_cli(capsys, "run", bare, "--prompt-ids", "1")
    assert code == 2
    assert_one_line_error(err, "run", f"{bare}: not a valid ONNX model", "No graph")


def _onnx_with_external_data(directory: Path, location: str) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        weight.external_data.add(key=key, value=value)
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in "xy"]
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", io[:1], io[1:])
    graph.initializer.append(weight)
    path = directory / "model.onnx"
    onnx.save(helper.make_model(graph), path)
    return path


def test_external_data_out_of_the_directory_is_refused(tmp_path):
    """onnxruntime < 1.24 (the newest for Python 3.10) reads whatever ``location`` names;
    those releases get this check before a model is loaded."""
    from attnexport.artifact.onnx_data import check_external_data
    from attnexport.contained_files import UnsafePathError

    directory = tmp_path / "artifact"
    directory.mkdir()
    (tmp_path / "secret.bin").write_bytes(bytes(16))
    (directory / "weights.bin").write_bytes(bytes(16))
    (directory / "linked.bin").symlink_to(tmp_path / "secret.bin")
    check_external_data(_onnx_with_external_data(directory, "weights.bin"))
    for location in ("../secret.bin", str(tmp_path / "secret.bin"), "linked.bin"):
        with pytest.raises(UnsafePathError):
            check_external_data(_onnx_with_external_data(directory, location))
    with pytest.raises(ArtifactError, match="is not a file of"):
        check_external_data(_onnx_with_external_data(directory, "missing.bin"))


def test_only_listed_model_files_are_loaded(tmp_path, llama_export, capsys):
    """A model.onnx the manifest does not list (left by someone else) is never picked."""
    out = tmp_path / "pt2_only"
    assert main(["export", "llama", "--out", str(out), "--format", "pt2"]) == 0
    shutil.copy(llama_export / "model.onnx", out / "model.onnx")
    assert resolve_artifact(out) == ("torch", out / "model.pt2")
    with pytest.raises(ArtifactError, match=r"no model\.onnx"):
        resolve_artifact(out, "ort")
    with pytest.raises(ArtifactError, match="not a model file"):
        resolve_artifact(out / "model.onnx")
    capsys.readouterr()
    code, _, err = run_cli(capsys, "run", out / "model.onnx", "--prompt-ids", "1")
    assert code == 2
    assert_one_line_error(err, "run", "model.onnx", "only listed files are loaded")


# ----------------------------------------------------------------------------- zoo vs path


def test_a_zoo_name_is_not_shadowed_by_a_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("llama").mkdir()  # not a checkpoint (no config.json), e.g. an earlier --out
    code, out, _ = run_cli(capsys, "export", "llama", "--out", "x")
    assert code == 0 and "zoo model llama" in out
    (Path("llama") / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = run_cli(capsys, "export", "llama", "--out", "y")
    assert code == 2
    assert_one_line_error(err, "export", "zoo:llama", "./llama")
    code, _, _ = run_cli(capsys, "export", "zoo:llama", "--out", "y", "--json")
    assert code == 0
    manifest = json.loads(Path("y/manifest.json").read_text())
    assert manifest["source"] == {"kind": "zoo", "name": "llama", "seed": 0}
    # verify rebuilds the zoo model, not the ./llama checkpoint beside it
    code, out, _ = run_cli(capsys, "verify", "y", "--json")
    assert code == 0 and json.loads(out)["reference"] == "eager[sdpa]"
