"""The ways the parity tests run a model: eager, the torch.export ExportedProgram, and the
ONNX file from ``attnexport.lowering.to_onnx`` on onnxruntime (the nodes' standard-op bodies,
or the native kernels); paged decoders also through a saved ``.pt2`` and the runtime's two
executors (:func:`engine_executor`)."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from attnexport.model_interface import DECODER_INPUT_NAMES
from attnexport.runtime.step_driver import PagedDriver, Runner

EXECUTORS = ("eager", "exported", "onnx")
PAGED_EXECUTORS = ("eager", "pt2", "onnx", "onnx-native")
"""The legs of the paged decoders' parity: ``pt2`` is the exported program saved and loaded
back, ``onnx`` runs the bodies, ``onnx-native`` the native kernels."""
ENGINE_EXECUTORS = ("torch-pt2", "ort-bodies", "ort-native")
"""The runtime executors of the engine legs: TorchExecutor on the ``.pt2``, OrtExecutor on the
``.onnx`` with either kernel mode."""


@dataclass
class Exports:
    """One model exported once for every leg that runs it."""

    pt2: Path
    onnx: Path
    rope_switch_length: int | None = None
    """The module's (LongRoPE); the ``.onnx`` records it, the ``.pt2`` does not (an export
    directory's manifest does, which the loader passes to TorchExecutor)."""

    @functools.cached_property
    def program(self) -> torch.export.ExportedProgram:
        """The ``.pt2`` loaded back (once, by the first leg that needs it)."""
        from attnexport.artifact import load_pt2

        return load_pt2(self.pt2)


def write_exports(module: torch.nn.Module, block_size: int, directory: Path) -> Exports:
    """``module``'s ``model.pt2`` (``torch.export.save``) and ``model.onnx`` (``to_onnx``, its
    cache contract included) in ``directory``."""
    from attnexport.lowering import to_onnx

    sample = module.export_sample(block_size)
    pt2, onnx_path = Path(directory) / "model.pt2", Path(directory) / "model.onnx"
    torch.export.save(sample.export(module), pt2)
    to_onnx(
        module,
        sample.args,
        onnx_path,
        dynamic_shapes=sample.dynamic_shapes,
        output_names=["logits"],
        cache_spec=module.cache_spec(block_size),
    )
    return Exports(pt2, onnx_path, getattr(module, "rope_switch_length", None))


def _skip_without_native_kernels() -> None:
    from attnexport import ort_kernels

    reason = ort_kernels.unavailable_reason()
    if reason is not None:
        pytest.skip(f"native kernels: {reason}")


def paged_runner(module: torch.nn.Module, executor: str, exports: Exports | None) -> Runner:
    """A :class:`PagedDriver` runner of the paged decoder ``module`` through ``executor`` (one
    of :data:`PAGED_EXECUTORS`), on the files of ``exports`` (unused by ``eager``)."""
    if executor == "eager":
        call = module
    elif executor == "pt2":
        call = exports.program.module()
    elif executor in ("onnx", "onnx-native"):
        from attnexport import lowering

        options = None
        if executor == "onnx-native":
            import onnxruntime as ort

            from attnexport import ort_kernels

            _skip_without_native_kernels()
            options = ort.SessionOptions()
            ort_kernels.register(options)
        session = lowering.PagedOrtSession(exports.onnx, session_options=options)
        names = (*DECODER_INPUT_NAMES, "kv_caches")

        def call(*args):
            return next(iter(session.run(dict(zip(names, args, strict=True))).values()))
    else:
        raise ValueError(f"executor: expected one of {PAGED_EXECUTORS}, got {executor!r}")

    def run(args: tuple, kv_caches: list) -> tuple[torch.Tensor, list]:
        with torch.no_grad():
            return call(*args, kv_caches), kv_caches

    return run


def engine_executor(executor: str, exports: Exports):
    """The runtime executor ``executor`` (one of :data:`ENGINE_EXECUTORS`) on ``exports``."""
    from attnexport.runtime import OrtExecutor, TorchExecutor

    if executor == "torch-pt2":
        return TorchExecutor(exports.program, rope_switch_length=exports.rope_switch_length)
    if executor == "ort-native":
        _skip_without_native_kernels()
    if executor in ("ort-bodies", "ort-native"):
        return OrtExecutor(exports.onnx, num_threads=1, kernels=executor.removeprefix("ort-"))
    raise ValueError(f"executor: expected one of {ENGINE_EXECUTORS}, got {executor!r}")


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
