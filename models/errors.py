"""Errors of the model zoo. Both are ``ValueError`` subclasses so callers can catch either."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """A Hugging Face architecture or config option the zoo does not implement."""


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read or whose weights do not fit the config."""
