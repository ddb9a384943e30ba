"""Flags that several commands share."""

from __future__ import annotations

from attnexport.cli import choices
from attnexport.cli.errors import CliError


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


def add_kv_cache_memory_flag(parser, default: str) -> None:
    """``--kv-cache-memory GIB`` of the commands that generate (``default`` says what the
    pool is without it)."""
    parser.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        metavar="GIB",
        help=f"KV-cache pool size in GiB (default: {default})",
    )


def add_engine_flags(parser, kv_cache_default: str) -> None:
    """The flags of the commands that generate from an export directory (``run``, ``serve``):
    ``--executor``, ``--backend``, ``--device``, ``--kv-cache-memory`` (``kv_cache_default``
    says what the pool is without it) and ``--trust-remote-pickle``."""
    add_executor_flag(parser)
    add_kernel_flags(parser)
    add_kv_cache_memory_flag(parser, kv_cache_default)
    add_trust_flag(parser)


def kv_cache_bytes(args) -> int | None:
    """``--kv-cache-memory`` in bytes (None when not given); CliError unless it is > 0."""
    gib = args.kv_cache_memory
    if gib is None:
        return None
    if not gib > 0 or gib == float("inf"):
        raise CliError(f"--kv-cache-memory: expected a size in GiB > 0, got {gib}")
    return int(gib * 2**30)
