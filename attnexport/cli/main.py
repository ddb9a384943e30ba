"""Entry point: parses arguments and dispatches to one module per command."""

from __future__ import annotations

import argparse
import sys

from attnexport._version import __version__
from attnexport.cli import backends_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnexport",
        description="Exportable paged attention: export, run, verify and benchmark models.",
    )
    parser.add_argument("--version", action="version", version=f"attnexport {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    backends_cmd.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
