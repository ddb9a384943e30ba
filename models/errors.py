"""Errors of the model zoo: user errors (:class:`attnexport.errors.UserError`, a
``ValueError``), so the CLI reports them on one line with exit code 2."""

from __future__ import annotations

from attnexport.errors import UserError


class UnsupportedModelError(UserError):
    """A Hugging Face architecture or config option the zoo does not implement."""


class CheckpointError(UserError):
    """A checkpoint directory that cannot be read or whose weights do not fit the config."""


class ModelRefError(UserError):
    """A model reference that names no zoo model or checkpoint directory, or both."""
