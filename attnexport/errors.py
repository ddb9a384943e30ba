"""The one type for mistakes a user can fix, raisable from every layer (ops, runtime, models,
lowering, CLI) without importing the CLI.

The CLI exits 2 with the message on one line for a :class:`UserError` and 1 (an internal
error) for anything else, so the classification is made where the error is raised, by the code
that knows the input was the user's: a bad argument, file, config field or flag.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input the user can fix; the message names the argument, file or field and what was
    expected. A ``ValueError`` subclass so callers catching ``ValueError`` keep working."""


class MissingDependencyError(UserError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra to install."""


def require(module: str, extra: str, purpose: str):
    """``importlib.import_module(module)``; :class:`MissingDependencyError` naming
    ``pip install "attnexport[extra]"`` when it is not installed.

    Args:
        module: the import name (``transformers``, ``safetensors.torch``, ...).
        extra: the attnexport extra that installs it (``hf``, ``xformers``, ...).
        purpose: what needs it, e.g. ``"reading *.safetensors checkpoints"``.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is None or module.split(".")[0] != error.name.split(".")[0]:
            raise  # a missing module inside the dependency is its bug, not a missing extra
        missing = MissingDependencyError(
            f"{purpose} needs {error.name}, which is not installed: "
            f'pip install "attnexport[{extra}]"'
        )
        missing.name = error.name
        raise missing from None


def installed(module: str) -> bool:
    """Whether ``module`` can be imported, found without importing it (torch takes seconds)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a blocked or half-imported module
        return False


class UserTypeError(UserError, TypeError):
    """An argument of the wrong type (also a ``TypeError``)."""
