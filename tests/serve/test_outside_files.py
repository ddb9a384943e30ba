"""Nothing outside the artifact is read: a ``chat_template.jinja`` linked to a file of the
machine made ``run --chat`` and the server render that file into every chat prompt (a client
read ``/etc/passwd`` back through ``prompt_token_ids``). A link in an export directory is
refused before anything is loaded, whatever it leads to, and so is a directory with a model
file but no manifest."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("fastapi", reason="needs the serve extra (fastapi, uvicorn)")

from attnexport.artifact import IncompleteArtifactError
from attnexport.contained_files import UnsafePathError
from attnexport.serve.served_model import load_served_model
from tests.cli.helpers import assert_one_line_error, run_cli

SECRET = "root:x:0:0:SECRET-LINE:/root:/bin/bash\n"


@pytest.fixture
def artifact(chat_export, tmp_path):
    """A copy of the session's chat export (model files hard-linked: same bytes, same digest)."""
    copy = tmp_path / "artifact"
    copy.mkdir()
    for entry in chat_export[0].iterdir():
        try:
            os.link(entry, copy / entry.name)
        except OSError:  # another file system
            shutil.copy2(entry, copy / entry.name)
    return copy


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "passwd"
    path.write_text(SECRET)
    return path


def test_run_chat_does_not_render_a_linked_chat_template(artifact, secret, capsys):
    (artifact / "chat_template.jinja").symlink_to(secret)
    code, out, err = run_cli(capsys, "run", artifact, "--chat", "hi", "--max-tokens", 1, "--json")
    assert code == 2, out
    assert_one_line_error(err, "run", f"{artifact / 'chat_template.jinja'}: a symbolic link")
    assert "SECRET" not in out + err


def test_the_server_does_not_start_over_a_linked_chat_template(artifact, secret):
    (artifact / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"chat_template\.jinja: a symbolic link"):
        load_served_model(artifact)


@pytest.mark.parametrize("name", ["model.onnx", "manifest.json"])
def test_a_linked_model_file_or_manifest_is_refused(name, artifact, chat_export, capsys):
    """Even one leading to the very file the manifest's digest describes."""
    (artifact / name).unlink()
    (artifact / name).symlink_to(chat_export[0] / name)
    code, _, err = run_cli(capsys, "run", artifact, "--prompt-ids", "1,2", "--max-tokens", 1)
    assert code == 2
    assert_one_line_error(err, "run", f"{artifact / name}: a symbolic link")
    with pytest.raises(UnsafePathError):
        load_served_model(artifact)


def test_a_model_without_its_manifest_is_refused(artifact, capsys):
    """What an interrupted export used to leave: loading it would have served whatever model
    file it held (the float model of an interrupted --weights int4 export)."""
    (artifact / "manifest.json").unlink()
    for argv in (
        ("run", artifact, "--prompt-ids", "1,2", "--max-tokens", 1),
        ("verify", artifact),
        ("inspect", artifact),
        ("embed", artifact, "--text", "hi"),
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 2, argv
        assert_one_line_error(err, argv[0], str(artifact), "no manifest.json", "interrupted")
    with pytest.raises(IncompleteArtifactError):
        load_served_model(artifact)
    from attnexport.runtime import Engine

    with pytest.raises(IncompleteArtifactError):
        Engine.from_path(artifact)
