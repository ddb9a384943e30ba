"""The op registry of the torch face: every op's :class:`~.spec.OpSpec` by name, built by
importing the slices of :data:`~.slices.OP_SLICES` (``attnexport.custom_ops`` re-exports it;
:mod:`.reference` reads it lazily, without importing the package that imports the slices)."""

from __future__ import annotations

import importlib

from attnexport.custom_ops.slices import OP_SLICES
from attnexport.custom_ops.spec import OpSpec

OP_SPECS: dict[str, OpSpec] = {
    spec.name: spec
    for name in OP_SLICES
    for spec in importlib.import_module(f"attnexport.custom_ops.{name}").SPECS
}
"""Every ``attnexport::`` op by name, in slice order."""

CACHE_ARGUMENTS: dict[str, tuple[tuple[int, str], ...]] = {
    name: spec.cache_argument_positions() for name, spec in OP_SPECS.items() if spec.cache_arguments
}
"""Op name -> ``(argument index, argument name)`` of each KV-cache argument."""
