"""The ``attnexport`` command line."""

from attnexport.cli.main import main

__all__ = ["main"]
