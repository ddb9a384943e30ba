"""Crafted ``.pt2`` archives never run code: every entry ``torch.export.load`` would unpickle
(or execute) is refused before loading, through ``attnexport run``, ``verify``,
``Engine.from_path`` and :func:`attnexport.artifact.load_pt2`, unless the user trusts the file.

Each payload is a real pickle whose ``__reduce__`` calls ``os.system("touch MARKER")``; the
trusted load shows that the payload is live (``torch.export.load`` runs it)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from attnexport.artifact import UnsafeArtifactError, file_digest, load_pt2
from attnexport.cli.main import main
from attnexport.runtime import Engine

PICKLE_FREE_FORMAT = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 9)
"""torch >= 2.9 saves weights as raw bytes; torch 2.8 pickles them into data/weights/model.pt
(read with the restricted unpickler only)."""
needs_pickle_free_format = pytest.mark.skipif(
    not PICKLE_FREE_FORMAT, reason="torch < 2.9 writes no payload configs"
)


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _rewrite(source: Path, target: Path, edit) -> None:
    """Copies the zip ``source`` to ``target``; ``edit(entries)`` changes the dict of
    archive-relative name -> bytes (the archive root is kept)."""
    with zipfile.ZipFile(source) as archive:
        names = archive.namelist()
        root = names[0].split("/")[0]
        entries = {n[len(root) + 1 :]: archive.read(n) for n in names}
    edit(entries)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in entries.items():
            archive.writestr(f"{root}/{name}", data)


def _config(entries: dict, name: str) -> dict:
    return json.loads(entries[name]) if name in entries else {"config": {}}


def _pickled_weight(entries: dict, payload: bytes) -> None:
    config = _config(entries, "data/weights/model_weights_config.json")
    meta = next(iter(config["config"].values()))
    meta["use_pickle"] = True
    entries[f"data/weights/{meta['path_name']}"] = payload
    entries["data/weights/model_weights_config.json"] = json.dumps(config).encode()


def _constant(path_name: str, use_pickle: bool):
    def edit(entries: dict, payload: bytes) -> None:
        config = _config(entries, "data/constants/model_constants_config.json")
        config["config"]["evil"] = {
            "path_name": path_name,
            "is_param": False,
            "use_pickle": use_pickle,
            "tensor_meta": None,
        }
        entries[f"data/constants/{path_name}"] = payload
        entries["data/constants/model_constants_config.json"] = json.dumps(config).encode()

    return edit


def _sample_inputs(entries: dict, payload: bytes) -> None:
    entries["data/sample_inputs/model.pt"] = payload


def _legacy_weights(entries: dict, payload: bytes) -> None:
    entries["data/weights/model.pt"] = payload


def _aoti(entries: dict, payload: bytes) -> None:
    entries["data/aotinductor/model/model.so"] = payload


CRAFTS = {
    "weight marked use_pickle": _pickled_weight,
    "tensor constant marked use_pickle": _constant("tensor_99", True),
    "opaque object": _constant("opaque_obj_0", True),
    "sample inputs": _sample_inputs,
    "legacy weights file": _legacy_weights,
}
"""Entries torch.export.load reads with Python's unpickler (the payload runs when trusted)."""


@pytest.fixture(scope="module")
def pt2_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("pt2_export")
    assert main(["export", "llama", "--out", str(out), "--format", "pt2"]) == 0
    return out


def _crafted_export(pt2_export: Path, tmp_path: Path, craft, marker: Path) -> Path:
    """A copy of the export whose model.pt2 holds the payload, with a manifest that records
    the crafted file (as an attacker would ship it)."""
    directory = tmp_path / "crafted"
    shutil.copytree(pt2_export, directory)
    payload = pickle.dumps(_Payload(marker))
    _rewrite(pt2_export / "model.pt2", directory / "model.pt2", lambda e: craft(e, payload))
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["file_digests"]["model.pt2"] = file_digest(directory / "model.pt2")
    (directory / "manifest.json").write_text(json.dumps(manifest))
    return directory


@needs_pickle_free_format
def test_our_exports_hold_no_pickle(pt2_export):
    """The sample inputs, the one entry torch.export.save pickles, are written empty."""
    with zipfile.ZipFile(pt2_export / "model.pt2") as archive:
        sizes = {n.split("/", 1)[1]: archive.getinfo(n).file_size for n in archive.namelist()}
        weights = json.loads(
            archive.read(next(n for n in archive.namelist() if n.endswith("weights_config.json")))
        )
    assert sizes["data/sample_inputs/model.pt"] == 0
    assert not any(m["use_pickle"] for m in weights["config"].values())
    load_pt2(pt2_export / "model.pt2")  # loads without trust


@pytest.mark.parametrize("craft", list(CRAFTS), ids=str)
def test_every_pickle_site_is_refused_and_the_payload_is_live(craft, pt2_export, tmp_path):
    if not PICKLE_FREE_FORMAT and craft not in ("sample inputs", "legacy weights file"):
        pytest.skip("torch < 2.9 archives have no payload configs to mark")
    marker = tmp_path / "code-ran"
    directory = _crafted_export(pt2_export, tmp_path, CRAFTS[craft], marker)
    with pytest.raises(UnsafeArtifactError, match=r"model\.pt2.*trust-remote-pickle"):
        load_pt2(directory / "model.pt2")
    assert not marker.exists()
    # trusted, torch.export.load runs the payload: the refusal above is what stops it
    with contextlib.suppress(Exception):
        load_pt2(directory / "model.pt2", trust_pickle=True)
    assert marker.exists(), "the crafted payload did not run under a trusted load"


@pytest.mark.parametrize(
    "craft,match",
    [(_aoti, "aotinductor"), (_constant("custom_obj_0", True), "custom_obj_0")],
    ids=["AOTInductor library", "torchbind object (TorchScript unpickler)"],
)
def test_other_loaded_payloads_are_refused(craft, match, pt2_export, tmp_path):
    directory = _crafted_export(pt2_export, tmp_path, craft, tmp_path / "unused")
    with pytest.raises(UnsafeArtifactError, match=match):
        load_pt2(directory / "model.pt2")


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "{dir}", "--prompt-ids", "1,2", "--max-tokens", "2"],
        ["run", "{dir}/model.pt2", "--prompt-ids", "1,2", "--max-tokens", "2"],
        ["verify", "{dir}"],
    ],
    ids=lambda v: " ".join(v[:2]),
)
def test_cli_refuses_with_exit_code_2(argv, pt2_export, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    craft = _pickled_weight if PICKLE_FREE_FORMAT else _legacy_weights
    directory = _crafted_export(pt2_export, tmp_path, craft, marker)
    capsys.readouterr()
    code = main([a.format(dir=directory) for a in argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "model.pt2" in err and "trust-remote-pickle" in err
    assert not marker.exists()


def test_cli_trust_flag_loads_the_file(pt2_export, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    directory = _crafted_export(pt2_export, tmp_path, _sample_inputs, marker)
    main(["run", str(directory), "--prompt-ids", "1", "--max-tokens", "1", "--trust-remote-pickle"])
    assert marker.exists()


def test_engine_from_path_refuses(pt2_export, tmp_path):
    marker = tmp_path / "code-ran"
    directory = _crafted_export(pt2_export, tmp_path, _constant("opaque_obj_0", True), marker)
    with pytest.raises(UnsafeArtifactError, match="opaque_obj_0"):
        Engine.from_path(directory)
    with pytest.raises(UnsafeArtifactError):
        Engine.from_path(directory / "model.pt2", executor="torch")
    assert not marker.exists()
