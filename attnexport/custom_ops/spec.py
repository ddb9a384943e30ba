"""The torch face of one op, as data: what each slice's ``SPECS`` lists and what the registries
of :mod:`attnexport.custom_ops` are built from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class OpSpec:
    """One ``attnexport::<name>`` op.

    ``kernel``, ``fake`` and ``reference`` take the op's arguments in schema order (the slice's
    checks, which the kernel and the fake run first, take its typed call where it has one).
    :func:`~.library.register` registers the op and returns the function users call; the slice
    binds it to the op's name.
    """

    name: str
    schema: str
    """The argument and return part of the ``torch.library`` schema, ``(...) -> ...``."""
    kernel: Callable[..., Any]
    """The implementation the dispatcher runs (validates, then computes or dispatches)."""
    fake: Callable[..., Any]
    """Shapes and dtypes only, for tracing (runs the static checks too)."""
    reference: Callable[..., Any]
    """The float64 definition of the op (tests compare every backend with it)."""
    cache_arguments: tuple[str, ...] = ()
    """The arguments that are paged KV caches ``[num_blocks, block_size, Hkv, D]``."""
    writes_caches: bool = False
    """The op writes its cache arguments in place (declared ``Tensor(a!)`` in the schema)."""
    backend_op: bool = False
    """The op runs on the selected kernel backend (:mod:`.dispatch`); else it is plain torch."""
    call_type: type | None = None
    """The typed call (a NamedTuple) whose fields are the op's arguments, when the kernel takes
    ``*args``: the registered function then has its signature."""

    @property
    def qualified_name(self) -> str:
        return f"attnexport::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        """The registered op, ``torch.ops.attnexport.<name>.default``."""
        return getattr(torch.ops.attnexport, self.name).default

    def cache_argument_positions(self) -> tuple[tuple[int, str], ...]:
        """``(argument index, argument name)`` of each cache argument, read from the registered
        schema."""
        names = [argument.name for argument in self.overload._schema.arguments]
        return tuple((names.index(name), name) for name in self.cache_arguments)
