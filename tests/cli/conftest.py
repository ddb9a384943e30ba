"""Fixtures of the CLI tests: one exported zoo model and one HF checkpoint, shared per module."""

from __future__ import annotations

import pytest

from attnexport.cli.main import main


@pytest.fixture(scope="session")
def llama_export(tmp_path_factory):
    """The tiny zoo Llama exported with both formats (ONNX + .pt2)."""
    out = tmp_path_factory.mktemp("llama_export")
    assert main(["export", "llama", "--out", str(out), "--format", "both"]) == 0
    return out
