"""The three ways the parity tests run a model: eager, the torch.export ExportedProgram, and the
ONNX file from ``attnexport.lowering.to_onnx`` on onnxruntime."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.models.driver import Runner

EXECUTORS = ("eager", "exported", "onnx")


def compile_module(
    module: torch.nn.Module, executor: str, block_size: int, workdir: Path | None
) -> Callable:
    """``module`` (a zoo model or a wrapper with ``export_sample``) as a callable taking the
    forward's positional arguments, run through ``executor``."""
    if executor == "eager":
        return module
    sample = module.export_sample(block_size)
    if executor == "exported":
        return sample.export(module).module()
    if executor == "onnx":
        return onnx_callable(module, sample, workdir)
    raise ValueError(f"executor: expected one of {EXECUTORS}, got {executor!r}")


def make_runner(
    module: torch.nn.Module, executor: str, block_size: int, workdir: Path | None
) -> Runner:
    """A :class:`PagedDriver` runner of a paged model through ``executor``."""
    call = compile_module(module, executor, block_size, workdir)

    def run(args: tuple, kv_caches: list) -> tuple[torch.Tensor, list]:
        with torch.no_grad():
            return call(*args, kv_caches), kv_caches

    return run


def onnx_callable(module, sample, workdir):
    from attnexport import lowering

    if not hasattr(lowering, "to_onnx"):
        pytest.skip("ONNX leg: attnexport.lowering.to_onnx is not on this branch yet")
    raise NotImplementedError  # filled in when the lowering lands
