"""Entry point: parses arguments, dispatches to one module per command, and turns user errors
into one line on stderr with exit code 2 (the traceback only with ``--debug``)."""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback
import warnings

from attnexport._version import __version__

COMMANDS = ("export", "run", "serve", "embed", "verify", "bench", "backends", "inspect", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnexport",
        description="Exportable paged attention: export models to ONNX / .pt2, run them with "
        "a paged KV cache, verify round trips and benchmark the kernel backends.",
    )
    parser.add_argument("--version", action="version", version=f"attnexport {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and warnings")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"attnexport.cli.{name}_cmd")
        module.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if not args.debug:
        warnings.filterwarnings("ignore")
    from attnexport.cli.errors import user_error_types

    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("attnexport: interrupted", file=sys.stderr)
        return 130
    except user_error_types() as error:
        if args.debug:
            traceback.print_exc()
        print(f"attnexport {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # a bug: still one line unless --debug
        if args.debug:
            raise
        print(
            f"attnexport {args.command}: internal error: {type(error).__name__}: "
            f"{_one_line(error)} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def entry() -> None:
    """The ``attnexport`` console script and ``python -m attnexport``: :func:`main`, then the
    exit. Python's teardown at exit runs full cycle collections over every object still alive
    (torch, and after an export its graphs): 1.1 s of SmolLM2-135M's 6.2 s ``export``. Frozen
    first (``gc.freeze``), they are left to the operating system, which frees the process
    anyway. Not in :func:`main`, which tests and scripts call many times in one process."""
    code = main()
    gc.freeze()
    sys.exit(code)


def _one_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    entry()
