"""User errors of the command line: one line, exit code 2, no traceback unless ``--debug``.

Whether an error is the user's is decided where it is raised: every layer raises
:class:`attnexport.errors.UserError` (or a subclass) for bad input, and anything else is an
internal error (exit code 1), whatever its exception class.
"""

from __future__ import annotations

from attnexport.errors import UserError


class CliError(UserError):
    """A mistake the user can fix; the message says what is wrong and how to fix it."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that describe bad input rather than a bug, from every layer."""
    return (UserError,)
