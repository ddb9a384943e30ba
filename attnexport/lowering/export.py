"""``export_program``: torch.export of a model on the attnexport ops, checked for lowering."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from torch.export import ExportedProgram

from attnexport.lowering import naming
from attnexport.lowering.passes import check_program

DIM_NAMES_META = "attnexport_dim_names"
"""``graph_module.meta`` key holding ``{(input, dim): name}`` of the caller's named Dims."""


@contextlib.contextmanager
def without_stack_traces() -> Iterator[None]:
    """Traces without recording the Python stack of every FX node: ``torch.export`` and
    torch.onnx's decomposition retrace each capture and format a traceback per node (~8% of
    SmolLM2's export), which torch.onnx would write into every ONNX node's metadata, with the
    exporting machine's source paths. torch's own errors do not read them. A torch without
    the switch (2.8) traces as it always did."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    previous = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = previous


def export_program(
    module: torch.nn.Module,
    args: tuple,
    *,
    dynamic_shapes=None,
    kwargs: Mapping | None = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export`` of a module that uses the attnexport ops, checked for lowering.

    The program keeps the in-place ``attnexport::reshape_and_cache`` (it runs in PyTorch with
    in-place cache writes and saves as ``.pt2`` with ``torch.export.save``);
    :func:`attnexport.lowering.to_onnx` makes it functional for ONNX.

    Args:
        module: the model; KV caches must be forward inputs (tensors, or lists/dicts of
            tensors), never parameters or buffers.
        args: sample positional inputs. Dimensions that vary from step to step (tokens,
            sequences, blocks) must be >= 2 in the samples: torch.export fixes sizes 0 and 1.
        dynamic_shapes: as for ``torch.export.export``. Use named ``Dim`` objects shared between
            inputs (``Dim("num_tokens")``); their names become the ONNX dimension names. When
            None, the first dimension of every tensor and every dimension of integer tensors
            is ``Dim.AUTO`` (dynamic unless the model fixes it, relations inferred), the others
            static; the export then fails if a token/sequence/block dimension came out static.
        kwargs: sample keyword inputs.
        strict: passed to ``torch.export.export``.

    Returns:
        The ``ExportedProgram``.

    Raises:
        ValueError: a cache is a module parameter/buffer/constant, a written cache is not a
            forward input itself, an input is modified in place by another op, or (automatic
            shapes) a step-varying dimension was fixed by the samples.
        TypeError: ``module`` is not an ``nn.Module``.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
    args = tuple(args)
    automatic = dynamic_shapes is None
    shapes = naming.auto_dynamic_shapes(module, args, kwargs) if automatic else dynamic_shapes
    with without_stack_traces():
        program = torch.export.export(
            module, args, kwargs=dict(kwargs or {}), dynamic_shapes=shapes, strict=strict
        )
    check_program(program)
    if automatic:
        fixed = naming.static_batch_dims(program)
        if fixed:
            raise ValueError(
                f"dynamic_shapes: torch.export fixed step-varying dimensions to their sample "
                f"size: {'; '.join(fixed)}. Give sample inputs where these sizes are >= 2 "
                f"(torch.export specializes sizes 0 and 1), or pass dynamic_shapes explicitly"
            )
    program.graph_module.meta[DIM_NAMES_META] = naming.user_dim_names(
        module, args, kwargs, dynamic_shapes
    )
    return program
