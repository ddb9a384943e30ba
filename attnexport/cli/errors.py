"""User errors of the command line: one line, exit code 2, no traceback unless ``--debug``."""

from __future__ import annotations


class CliError(Exception):
    """A mistake the user can fix; the message says what is wrong and how to fix it."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input rather than a bug, from every layer."""
    from attnexport.custom_ops import BackendUnsupportedError
    from models.errors import CheckpointError, UnsupportedModelError

    return (
        CliError,
        ValueError,
        TypeError,
        FileNotFoundError,
        NotADirectoryError,
        ModuleNotFoundError,
        BackendUnsupportedError,
        UnsupportedModelError,
        CheckpointError,
    )
