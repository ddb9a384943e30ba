"""Registration of the ``attnexport`` op namespace with ``torch.library``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from attnexport.custom_ops.spec import OpSpec

_LIB = torch.library.Library("attnexport", "DEF")


def register(spec: OpSpec) -> Callable:
    """Defines ``attnexport::<name><schema>`` with ``spec.kernel`` as its kernel on every device
    and ``spec.fake`` as its fake kernel, and returns a function of the kernel's signature (or
    the typed call's) and docstring that calls the op through the dispatcher, which is what
    torch.export records.

    The low-level registration, like vLLM's ``direct_register_custom_op``: ``torch.library.
    custom_op`` adds an autograd wrapper and a dynamo-disabled frame to every call, several times
    the dispatcher's cost (docs/benchmarks.md, "Measured design choices"). In-place
    ops declare what they write in the schema (``Tensor(a!)``)."""
    _LIB.define(spec.name + spec.schema)
    _LIB.impl(spec.name, _without_grad(spec.kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(spec.qualified_name, spec.fake, lib=_LIB)
    packet = getattr(torch.ops.attnexport, spec.name)

    @functools.wraps(spec.kernel)
    def call(*args, **kwargs):
        return packet(*args, **kwargs)

    if spec.call_type is not None:  # the kernel takes ``*args``: show the typed call's fields
        returns = inspect.signature(spec.kernel).return_annotation
        call.__signature__ = inspect.signature(spec.call_type).replace(return_annotation=returns)
    return call


def _without_grad(kernel: Callable) -> Callable:
    """``kernel`` recording no autograd history: the ops have no derivative, and a model run
    outside ``no_grad`` (parameters that require grad) must still run them (some kernels write
    into ``out=`` buffers, which autograd refuses). A context is entered only when grad mode is
    on: the engine's steps run under ``no_grad`` and pay one check."""

    @functools.wraps(kernel)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            with torch.no_grad():
                return kernel(*args, **kwargs)
        return kernel(*args, **kwargs)

    return run
