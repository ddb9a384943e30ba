"""The errors of export directories and model files."""

from __future__ import annotations

from attnexport.errors import UserError


class ArtifactError(UserError):
    """An export directory or model file that cannot be used; the message names the file and
    says how to fix it."""


class UnsafeArtifactError(ArtifactError):
    """A ``.pt2`` archive with entries that loading would unpickle or execute."""


class IncompleteArtifactError(ArtifactError):
    """An export directory holding a model file but no ``manifest.json``: an interrupted or
    hand-assembled export, which would otherwise load as whatever model file it holds (the
    float model of an interrupted ``--weights int4`` export)."""
