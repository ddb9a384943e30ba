"""The longest sequence is the model's: a ``max_model_len`` above the positions a model was
trained for is refused where it is given (a manifest field, ``serve --max-model-len``,
``load_executor``), with exit code 2 and one line, before anything is allocated or served."""

from __future__ import annotations

import json
import shutil

import pytest

from attnexport.errors import UserError
from tests.cli.helpers import assert_one_line_error, run_cli, stop_before_serving

POSITIONS = 2048  # the zoo Llama's max_position_embeddings


def _with_manifest(llama_export, tmp_path, drop_positions: bool = False, **changes):
    directory = tmp_path / "export"
    shutil.copytree(llama_export, directory)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["config"]["max_position_embeddings"] == POSITIONS
    manifest.update(changes)
    if drop_positions:
        del manifest["config"]["max_position_embeddings"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@pytest.mark.parametrize(
    "max_model_len,drop_positions,needle",
    [
        (POSITIONS + 1, False, f"is longer than the model's {POSITIONS} positions"),
        # run tried to allocate a pool for one sequence of 10^12 tokens (116 TiB)
        (10**12, False, f"is longer than the model's {POSITIONS} positions"),
        (10**12, True, "sequence lengths are int32"),
    ],
)
def test_a_manifest_max_model_len_above_the_positions_exits_2(
    llama_export, tmp_path, capsys, max_model_len, drop_positions, needle
):
    directory = _with_manifest(llama_export, tmp_path, drop_positions, max_model_len=max_model_len)
    code, _, err = run_cli(capsys, "run", directory, "--prompt-ids", "1,2,3", "--max-tokens", 2)
    assert code == 2, err
    assert_one_line_error(err, "run", str(directory / "manifest.json"), "'max_model_len'", needle)


def test_serve_refuses_a_max_model_len_above_the_models_at_start(llama_export, monkeypatch, capsys):
    """serve took --max-model-len 4096 over a 2048-position model: the first request crossing
    position 2048 failed the executor's step, and every request batched with it."""
    pytest.importorskip("fastapi", reason="needs the serve extra")
    stop_before_serving(monkeypatch)
    code, _, err = run_cli(capsys, "serve", llama_export, "--max-model-len", 2 * POSITIONS)
    assert code == 2, err
    assert_one_line_error(
        err,
        "serve",
        f"max_model_len: {2 * POSITIONS} is longer than the model's maximum length {POSITIONS}",
    )


def test_load_executor_refuses_a_max_model_len_above_the_manifests(llama_export):
    from attnexport.runtime import load_executor

    with pytest.raises(UserError, match="its export manifest's max_model_len"):
        load_executor(llama_export, max_model_len=POSITIONS + 1)
    assert load_executor(llama_export, max_model_len=64).max_model_len == 64
    assert load_executor(llama_export / "model.onnx").max_model_len == POSITIONS
