"""The three ways the parity tests run a model: eager, the torch.export ExportedProgram, and the
ONNX file from ``attnexport.lowering.to_onnx`` on onnxruntime."""

from __future__ import annotations

from pathlib import Path

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
    """Exports ``model`` with ``attnexport.lowering.to_onnx`` and runs it on onnxruntime with IO
    binding: the caches are updated in place, so the runner returns the same list."""
    from attnexport.lowering import PagedOrtSession, to_onnx

    sample = model.export_sample(block_size)
    path = workdir / "model.onnx"
    to_onnx(
        model,
        sample.args,
        path,
        dynamic_shapes=sample.dynamic_shapes,
        cache_spec=model.cache_spec(block_size),
        output_names=["logits"],
    )
    session = PagedOrtSession(path)
    names = sample.input_names

    def run(args: tuple, kv_caches: list) -> tuple:
        inputs = dict(zip(names[:-1], args, strict=True))
        inputs[names[-1]] = kv_caches
        return session.run(inputs)["logits"], kv_caches

    return run
