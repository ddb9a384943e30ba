"""The ``attnexport`` command line."""

from attnexport.cli.main import entry, main

__all__ = ["entry", "main"]
