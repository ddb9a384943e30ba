"""Explicit per-step plans: what one step's metadata fixes, worked out once, reused by every layer.

An executor opens a plan around each forward (``with step_plan(metadata_tensors):``), as
FlashInfer's plan/run and vLLM's metadata builder do. Inside it, an op whose metadata tensors are
all the plan's own (the very tensor objects it was opened with) computes its value checks and its
backend's host-side plan on the first layer and finds them in the plan on every other layer. Any
other call (no plan open, or metadata the plan does not own) validates and plans in full, every
call.

The plan is the contract that the metadata does not change while it is open; it lives for one
step, so nothing it holds can describe an older step's metadata. There is no tensor-version
bookkeeping: versions miss writes through NumPy or ``.data`` and inference tensors have none.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator
from typing import Any

import torch

MISSING: Any = object()
"""What :meth:`StepPlan.get` returns for an entry the plan does not hold."""


class StepPlan:
    """Entries (validation results, backend plans) about a fixed set of metadata tensors.

    Args:
        tensors: the step's metadata tensors (``None`` entries are skipped). The plan holds
            them, so their ids stay theirs while it lives and can key its entries.
    """

    __slots__ = ("_entries", "_owned")

    def __init__(self, tensors: Iterable[torch.Tensor | None]) -> None:
        self._owned = {id(t): t for t in tensors if t is not None}
        self._entries: dict[tuple, Any] = {}

    def owns(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Whether every tensor of ``tensors`` is one the plan was opened with (or adopted)."""
        owned = self._owned
        return all(owned.get(id(t)) is t for t in tensors)

    def adopt(self, tensors: Iterable[torch.Tensor]) -> None:
        """Owns ``tensors`` too: tensors a plan entry made from owned ones (and that nothing
        writes), so that calls given them can use the plan as well."""
        for tensor in tensors:
            self._owned[id(tensor)] = tensor

    def get(self, key: tuple) -> Any:
        """The entry under ``key`` (from :func:`entry_key`), or :data:`MISSING`."""
        return self._entries.get(key, MISSING)

    def put(self, key: tuple, tensors: tuple[torch.Tensor, ...], value: Any) -> None:
        """Stores ``value`` under ``key`` if the plan owns ``tensors`` (the tensors the key
        names); otherwise nothing is stored and later calls compute it again."""
        if self.owns(tensors):
            self._entries[key] = value

    def __len__(self) -> int:
        return len(self._entries)


_active: contextvars.ContextVar[StepPlan | None] = contextvars.ContextVar(
    "attnexport_step_plan", default=None
)


def current_step_plan() -> StepPlan | None:
    """The plan open in this context, or None."""
    return _active.get()


def entry_key(kind: str, tensors: tuple[torch.Tensor, ...], extra: tuple) -> tuple:
    """The key of an entry about ``tensors`` (by identity: valid while a plan owns them)."""
    return (kind, *map(id, tensors), *extra)


@contextlib.contextmanager
def step_plan(tensors: Iterable[torch.Tensor | None]) -> Iterator[StepPlan]:
    """Opens a :class:`StepPlan` over a step's metadata tensors for the enclosed op calls.

    The caller must not change those tensors while the plan is open (an executor builds them
    for the step and runs one forward). Plans nest: the innermost one is used.
    """
    plan = StepPlan(tensors)
    token = _active.set(plan)
    try:
        yield plan
    finally:
        _active.reset(token)


def memoised(kind: str, tensors: tuple[torch.Tensor, ...], extra: tuple, build) -> Any:
    """``build()``, kept in the open plan when it owns ``tensors`` (``extra``: whatever else the
    result depends on, hashable; ``kind`` names the caller, so entries of different callers
    never meet); computed every call when no plan is open or it does not own them. ``build``
    must not return :data:`MISSING` (a check with no result returns True)."""
    plan = _active.get()
    if plan is None:
        return build()
    key = entry_key(kind, tensors, extra)
    value = plan.get(key)
    if value is MISSING:
        value = build()
        plan.put(key, tensors, value)
    return value
