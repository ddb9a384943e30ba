"""Exit codes by cause: a user's mistake (a bad config.json value, NaN weights, a missing
optional dependency, a shard index pointing outside the checkpoint) exits 2 with one line naming
the file and field; anything else is an internal error, exit 1, whatever its exception class."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from attnexport.cli.main import main
from attnexport.errors import MissingDependencyError, require
from tests.cli.helpers import assert_one_line_error, run_cli
from tests.models.hf_reference import tiny_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_llama_tiny")
    tiny_llama(path)
    return path


def _with_config(checkpoint, tmp_path, **changes):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"hidden_size": -32}, "hidden_size"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"rope_parameters": {"rope_theta": "fast", "rope_type": "default"}}, "config.json"),
        # not a token id (an end token past the vocabulary is left out instead:
        # test_end_tokens_past_the_vocabulary_are_left_out)
        ({"eos_token_id": [2, -5]}, "eos_token_id"),
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"forced_eos_token_id": -1}, "forced_eos_token_id"),
    ],
    ids=lambda v: json.dumps(v) if isinstance(v, dict) else None,
)
def test_bad_config_values_exit_2_naming_file_and_field(
    changes, field, checkpoint, tmp_path, capsys
):
    path = _with_config(checkpoint, tmp_path, **changes)
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2, err
    assert_one_line_error(err, "export", str(path / "config.json"), field)


def test_nan_weights_are_refused_at_export(checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    weights["model.layers.0.mlp.up_proj.weight"][3, 4] = float("nan")
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", "NaN", "up_proj")
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_shard_index_outside_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(path / "model.safetensors", outside)
    index = {"weight_map": {"lm_head.weight": "../elsewhere.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", "model.safetensors.index.json", "../elsewhere.safetensors")


def test_shard_symlinked_outside_the_checkpoint_is_refused(checkpoint, tmp_path, capsys):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(path / "model.safetensors", outside)
    (path / "model-00001.safetensors").symlink_to(outside)
    index = {"weight_map": {"lm_head.weight": "model-00001.safetensors"}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", str(path / "model-00001.safetensors"), "symbolic link")


def test_bad_generation_config_values_exit_2(checkpoint, tmp_path, capsys):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", str(path / "generation_config.json"), "eos_token_id")
    assert not (tmp_path / "out").exists()


def test_end_tokens_past_the_vocabulary_are_left_out(checkpoint, tmp_path, capsys):
    """A checkpoint shrunk from a family's defaults keeps the family's end tokens (GLM's
    151329 with a vocabulary of 128): they can never be generated, so the export leaves them
    out instead of refusing the checkpoint. A negative id is still refused."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, vocab, 10**6]}))
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 0, err
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["generation"]["eos_token_ids"] == [3]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, -1]}))
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "again")
    assert code == 2
    assert_one_line_error(err, "export", "eos_token_id")


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json"]
)
def test_a_checkpoint_file_linked_outside_is_refused(name, checkpoint, tmp_path, capsys):
    """Neither read nor copied into the export: the link leads to a file export would take
    without complaint (a tokenizer file would land in the artifact, to be served)."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    if (path / name).exists():
        shutil.move(path / name, outside)
    else:
        outside.write_text("{}")
    (path / name).symlink_to(outside)
    code, _, err = run_cli(capsys, "export", path, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", f"{path / name}: a symbolic link")
    assert not (tmp_path / "out").exists()


def test_a_hub_cache_snapshot_exports(checkpoint, tmp_path, capsys):
    """huggingface_hub's cache: ``snapshots/<rev>/<file>`` links to ``blobs/<hash>``."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(checkpoint.iterdir())):
        shutil.copy2(file, repo / "blobs" / f"blob{i}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{i}")
    (repo / "blobs" / "tokenizer").write_text("{}")
    (snapshot / "tokenizer.json").symlink_to("../../blobs/tokenizer")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "export", snapshot, "--out", out, "--format", "pt2")
    assert code == 0, err
    copied = out / "tokenizer.json"
    assert copied.read_text() == "{}" and not copied.is_symlink()


def test_missing_optional_dependency_names_the_extra(checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors now fails
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    code, _, err = run_cli(capsys, "export", checkpoint, "--out", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, "export", "safetensors", 'pip install "attnexport[hf]"')
    with pytest.raises(MissingDependencyError, match=r"attnexport\[xformers\]"):
        require("attnexport_no_such_module", "xformers", "the xformers backend")


def test_an_internal_type_error_exits_1(monkeypatch, tmp_path, capsys):
    """A TypeError raised by our own code is a bug, not the user's: exit 1, traceback only
    with --debug (before, every TypeError was reported as a user error)."""
    import attnexport.cli.export_cmd as export_cmd

    def broken(*args, **kwargs):
        return None + 1  # a real TypeError from a bug

    monkeypatch.setattr(export_cmd, "export_artifact", broken)
    code, _, err = run_cli(capsys, "export", "llama", "--out", tmp_path / "out")
    assert code == 1 and "internal error: TypeError" in err and "Traceback" not in err
    with pytest.raises(TypeError):
        main(["--debug", "export", "llama", "--out", str(tmp_path / "out")])


def test_verify_says_when_the_source_checkpoint_is_gone(checkpoint, tmp_path, capsys):
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    out = tmp_path / "out"
    assert main(["export", str(path), "--out", str(out), "--format", "both"]) == 0
    shutil.rmtree(path)
    capsys.readouterr()
    code, out_json, _ = run_cli(capsys, "verify", out, "--json")
    report = json.loads(out_json)
    assert code == 0 and report["reference"] == "pt2"
    assert len(report["notes"]) == 1 and "is gone" in report["notes"][0]
    code, text, _ = run_cli(capsys, "verify", out)
    assert code == 0 and "is gone" in " ".join(text.split())


def test_verify_adds_a_transformers_leg(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(checkpoint), "--out", str(out), "--format", "both"]) == 0
    capsys.readouterr()
    code, text, _ = run_cli(capsys, "verify", out, "--json")
    report = json.loads(text)
    rows = {c["output"]: c for c in report["comparisons"] if c["leg"] == "transformers"}
    assert code == 0 and report["ok"] and report["notes"] == []
    assert {"prefill logits", "decode 3 logits"} <= set(rows)
    greedy = next(c for name, c in rows.items() if name.startswith("greedy tokens"))
    assert greedy["ok"] and greedy["max_abs"] == 0
    assert all(c["max_abs"] <= c["tolerance"] for c in rows.values())


def test_missing_transformers_names_the_extra(llama_export, tmp_path, monkeypatch, capsys):
    directory = tmp_path / "export"
    shutil.copytree(llama_export, directory)
    (directory / "tokenizer.json").write_text("{}")
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["tokenizer_files"] = ["tokenizer.json"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    # Text goes through transformers' AutoTokenizer (which needs tokenizers for tokenizer.json).
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = run_cli(capsys, "run", directory, "--prompt", "hello")
    assert code == 2
    assert_one_line_error(err, "run", "transformers", 'pip install "attnexport[hf]"')


def test_another_tools_onnx_model_is_a_user_error(tmp_path, capsys):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    onnx.save(helper.make_model(graph), tmp_path / "other.onnx")
    code, _, err = run_cli(capsys, "run", tmp_path / "other.onnx", "--prompt-ids", "1")
    assert code == 2
    assert_one_line_error(err, "run", "not an attnexport model")


def test_a_decoder_start_token_outside_the_vocabulary_is_a_user_error(tmp_path, capsys):
    """Refused by the engine (it knows the vocabulary): a user error, not an internal one."""
    out = tmp_path / "bart"
    assert main(["export", "bart", "--out", str(out)]) == 0
    capsys.readouterr()
    code, _, err = run_cli(
        capsys, "run", out, "--prompt-ids", "5,6", "--decoder-start-token-id", 999
    )
    assert code == 2
    assert_one_line_error(err, "run", "decoder_start_token_id 999 is outside the vocabulary")


def test_the_console_entry_exits_with_the_commands_code(tmp_path):
    """``python -m attnexport`` (the console script's ``entry``, which freezes the heap before
    the exit) exits with the command's code: 2 and the one-line error for a user error, 0 for
    ``--version``."""
    import subprocess

    missing = tmp_path / "missing"
    command = [sys.executable, "-m", "attnexport", "export", str(missing), "--out", "out"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result.stderr, "export", "is not a directory")
    version = subprocess.run([sys.executable, "-m", "attnexport", "--version"], capture_output=True)
    assert version.returncode == 0 and version.stdout.startswith(b"attnexport ")
