"""Flags that several commands share."""

from __future__ import annotations


def add_trust_flag(parser) -> None:
    """``--trust-remote-pickle`` of the commands that load a ``.pt2``."""
    parser.add_argument(
        "--trust-remote-pickle",
        action="store_true",
        help="load a .pt2 even if it holds pickled entries, which can run any code: only for "
        "files you trust (see docs/cli.md, 'What is safe to load')",
    )
