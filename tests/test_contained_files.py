"""The one check of what a loader may read from a user's directory
(:mod:`attnexport.contained_files`): the directory's own regular files, never a link, a special
file or a path out of it; a Hugging Face hub cache snapshot's links into its ``blobs`` only
where asked for."""

from __future__ import annotations

import os
import re
import sys

import pytest

from attnexport.contained_files import (
    UnsafePathError,
    check_entries,
    contained_file,
    read_json,
)
from attnexport.errors import UserError


@pytest.fixture
def secret(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("root:x:0:0")
    return path


def test_a_regular_file_is_read_and_a_missing_one_returned(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert contained_file(tmp_path, "config.json") == tmp_path / "config.json"
    assert not contained_file(tmp_path, "absent.json").exists()
    assert not contained_file(tmp_path, "absent/deeper.json").exists()


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_a_link_is_refused_wherever_it_leads(target, tmp_path, secret):
    directory = tmp_path / "artifact"
    directory.mkdir()
    (directory / "real.jinja").write_text("{{ messages }}")
    link = directory / "chat_template.jinja"
    link.symlink_to(secret if target == "outside" else directory / "real.jinja")
    with pytest.raises(UnsafePathError, match=r"chat_template\.jinja: a symbolic link") as error:
        contained_file(directory, "chat_template.jinja")
    assert isinstance(error.value, UserError)


@pytest.mark.parametrize("name", ["../secret.txt", "/etc/passwd", "sub/../../secret.txt", ""])
def test_a_name_out_of_the_directory_is_refused(name, tmp_path, secret):
    directory = tmp_path / "artifact"
    (directory / "sub").mkdir(parents=True)
    with pytest.raises(UnsafePathError, match="not a file of"):
        contained_file(directory, name)


def test_a_linked_subdirectory_is_refused(tmp_path, secret):
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    (directory / "1_Pooling").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="1_Pooling: a symbolic link"):
        contained_file(directory, "1_Pooling/secret.txt")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_not_opened(tmp_path):
    """Opening a FIFO would block the loader until something writes to it."""
    os.mkfifo(tmp_path / "tokenizer.json")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        contained_file(tmp_path, "tokenizer.json")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        check_entries(tmp_path)


def test_the_directory_itself_may_be_a_link(tmp_path):
    """It is the path the user gave."""
    real = tmp_path / "real"
    real.mkdir()
    (real / "manifest.json").write_text("{}")
    (tmp_path / "alias").symlink_to(real)
    assert contained_file(tmp_path / "alias", "manifest.json").is_file()
    check_entries(tmp_path / "alias")


def test_check_entries_refuses_any_link_in_the_directory_and_named_subdirectories(tmp_path, secret):
    directory = tmp_path / "tokenizer"
    (directory / "additional_chat_templates").mkdir(parents=True)
    (directory / "tokenizer.json").write_text("{}")
    check_entries(directory, ("additional_chat_templates",))
    (directory / "additional_chat_templates" / "tool_use.jinja").symlink_to(secret)
    check_entries(directory)  # not asked to look there
    with pytest.raises(UnsafePathError, match=r"tool_use\.jinja: a symbolic link"):
        check_entries(directory, ("additional_chat_templates",))
    (directory / "additional_chat_templates" / "tool_use.jinja").unlink()
    (directory / "vocab.txt").symlink_to(secret)
    with pytest.raises(UnsafePathError, match=r"vocab\.txt: a symbolic link"):
        check_entries(directory, ("additional_chat_templates",))


def test_a_linked_subdirectory_of_check_entries_is_refused(tmp_path):
    directory = tmp_path / "tokenizer"
    directory.mkdir()
    (directory / "additional_chat_templates").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="additional_chat_templates: a symbolic link"):
        check_entries(directory, ("additional_chat_templates",))


def _hub_snapshot(root, secret):
    """``models--org--name/{blobs,snapshots/abc}`` as huggingface_hub lays out its cache."""
    repo = root / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "0f1e2d").write_text('{"model_type": "llama"}')
    (snapshot / "config.json").symlink_to("../../blobs/0f1e2d")
    (repo / "blobs" / "linked").symlink_to(secret)
    return snapshot


def test_a_hub_snapshot_reads_its_blobs_and_nothing_else(tmp_path, secret):
    snapshot = _hub_snapshot(tmp_path, secret)
    assert read_json(contained_file(snapshot, "config.json", hub_links=True), UserError) == {
        "model_type": "llama"
    }
    check_entries(snapshot, hub_links=True)
    with pytest.raises(UnsafePathError, match="symbolic link"):  # only where asked for
        contained_file(snapshot, "config.json")
    refused = {
        "tokenizer.json": secret,  # out of the repository
        "vocab.txt": "../../blobs/linked",  # a blob that is itself a link
        "merges.txt": "../../blobs/../../secret.txt",  # through blobs and out
        "special_tokens_map.json": "../../snapshots/abc123/config.json",  # not a blob
    }
    for name, target in refused.items():
        (snapshot / name).symlink_to(target)
        message = rf"{re.escape(name)}: a symbolic link"
        with pytest.raises(UnsafePathError, match=message):
            contained_file(snapshot, name, hub_links=True)
        with pytest.raises(UnsafePathError, match=message):
            check_entries(snapshot, hub_links=True)
        (snapshot / name).unlink()


def test_a_linked_blobs_directory_is_no_hub_snapshot(tmp_path, secret):
    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "blobs").symlink_to(tmp_path)  # blobs/secret.txt would be the secret
    (snapshot / "config.json").symlink_to("../../blobs/secret.txt")
    with pytest.raises(UnsafePathError, match=r"config\.json: a symbolic link"):
        contained_file(snapshot, "config.json", hub_links=True)


@pytest.mark.parametrize(
    "text,reason",
    [
        ("[" * 100_000 + "]" * 100_000, "nested deeper than Python's JSON parser can read"),
        ("{not json", "Expecting property name"),
        (b'{"a": "\xff"}', "codec can't decode"),
    ],
    ids=["nested", "not-json", "not-utf8"],
)
def test_read_json_names_the_file_and_why(text, reason, tmp_path):
    path = tmp_path / "manifest.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert sys.getrecursionlimit() < 100_000
    with pytest.raises(UserError, match=rf"manifest\.json: not valid JSON \(.*{reason}") as error:
        read_json(path, UserError, hint="; re-export")
    assert str(error.value).endswith("; re-export")


def test_read_json_refuses_a_file_larger_than_its_bound(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("{}" + " " * 100)
    with pytest.raises(UserError, match="102 bytes, more than the 64 read"):
        read_json(path, UserError, max_bytes=64)
