"""The three ways the parity tests run a model: eager, the torch.export ExportedProgram, and the
ONNX file from ``attnexport.lowering.to_onnx`` on onnxruntime."""

from __future__ import annotations

from pathlib import Path

import pytest

from models.base import PagedModel
from tests.models.driver import Runner, module_runner

EXECUTORS = ("eager", "exported", "onnx")


def make_runner(model: PagedModel, executor: str, block_size: int, workdir: Path) -> Runner:
    """A runner of ``model`` through ``executor`` for caches of ``block_size``."""
    if executor == "eager":
        return module_runner(model)
    sample = model.export_sample(block_size)
    if executor == "exported":
        return module_runner(sample.export(model).module())
    if executor == "onnx":
        return onnx_runner(model, block_size, workdir)
    raise ValueError(f"executor: expected one of {EXECUTORS}, got {executor!r}")


def onnx_runner(model: PagedModel, block_size: int, workdir: Path) -> Runner:
    from attnexport import lowering

    if not hasattr(lowering, "to_onnx"):
        pytest.skip("ONNX leg: attnexport.lowering.to_onnx is not on this branch yet")
    raise NotImplementedError  # filled in when the lowering lands
