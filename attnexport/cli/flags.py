"""Flags that several commands share."""

from __future__ import annotations

from attnexport.cli import choices


def add_trust_flag(parser) -> None:
    """``--trust-remote-pickle`` of the commands that load a ``.pt2``."""
    parser.add_argument(
        "--trust-remote-pickle",
        action="store_true",
        help="load a .pt2 even if it holds pickled entries, which can run any code: only for "
        "files you trust (see docs/cli.md, 'What is safe to load')",
    )


def add_executor_flag(parser) -> None:
    """``--executor`` of the commands that run an export directory."""
    parser.add_argument(
        "--executor",
        choices=choices.executors(),
        default="auto",
        help="onnxruntime (default when model.onnx exists) or torch (.pt2)",
    )


def add_kernel_flags(parser) -> None:
    """``--backend`` and ``--device`` of the commands that generate from an export directory."""
    parser.add_argument(
        "--backend",
        choices=choices.attention_backends(),
        default="auto",
        # (a metavar keeps argparse from formatting the registry's choices when the parser is
        # built: the registry imports torch)
        metavar="BACKEND",
        help="attention backend of the torch executor: %(choices)s (default: auto)",
    )
    parser.add_argument("--device", choices=choices.devices(), default="cpu")
