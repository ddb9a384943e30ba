"""The three ways the parity tests run a model: eager, the torch.export ExportedProgram, and the
ONNX file from ``attnexport.lowering.to_onnx`` on onnxruntime."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from attnexport.runtime.step_driver import PagedDriver, Runner

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


def teacher_forced_logits(driver: PagedDriver, steps: int, vocab_size: int) -> list[torch.Tensor]:
    """A prefill (every position's logits) of the driver's sequences, then ``steps`` decode
    steps, each appending to every sequence a token drawn below ``vocab_size`` from
    ``random.Random(0)``; returns per sequence the logits of every step, concatenated:
    ``[prompt length + steps, vocab]``."""
    rng = random.Random(0)
    logits = [driver.prefill(all_logits=True)]
    sequences = range(len(driver.sequences))
    for _ in range(steps):
        for seq in sequences:
            driver.append(seq, rng.randrange(vocab_size))
        logits.append(driver.step(dict.fromkeys(sequences, 1)))
    return [torch.cat([step[seq] for step in logits]) for seq in sequences]


def onnx_callable(module: torch.nn.Module, sample, workdir: Path) -> Callable:
    """Exports ``module`` with ``attnexport.lowering.to_onnx`` and returns a callable running
    it in onnxruntime (CPU) through ``PagedOrtSession``: caches bound as input and output, so
    they are updated in place like the eager ones."""
    from attnexport import lowering

    if not hasattr(lowering, "to_onnx"):
        pytest.skip("ONNX leg: attnexport.lowering.to_onnx is not on this branch yet")
    path = Path(workdir) / "model.onnx"
    spec = getattr(module, "cache_spec", None)
    spec = spec(next(iter(sample.args[-1])).shape[1]) if isinstance(sample.args[-1], list) else None
    lowering.to_onnx(
        module, sample.args, path, dynamic_shapes=sample.dynamic_shapes, cache_spec=spec
    )
    session = lowering.PagedOrtSession(path)

    def call(*args):
        (output,) = session.run(dict(zip(sample.input_names, args, strict=True))).values()
        return output

    return call
