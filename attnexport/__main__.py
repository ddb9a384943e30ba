"""``python -m attnexport``: the command line (:func:`attnexport.cli.entry`)."""

from attnexport.cli import entry

entry()
