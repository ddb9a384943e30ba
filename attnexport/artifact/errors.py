"""The errors of export directories and model files."""

from __future__ import annotations

from attnexport.errors import UserError


class ArtifactError(UserError):
    """An export directory or model file that cannot be used; the message names the file and
    says how to fix it."""


class UnsafeArtifactError(ArtifactError):
    """A ``.pt2`` archive with entries that loading would unpickle or execute."""
