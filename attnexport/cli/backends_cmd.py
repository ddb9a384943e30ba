"""``attnexport backends``: which kernel backends exist, run here, and what they support: the
torch executor's attention backends and the onnxruntime executor's native kernels."""

from __future__ import annotations

import argparse
import json

from attnexport.cli.choices import TORCH_EXTRA
from attnexport.errors import installed


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "backends", help="list kernel backends, their availability and capabilities"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def backend_report() -> list[dict]:
    """One dict per registered backend: name, priority, availability, reason, capabilities
    (none without torch: the backends are torch's)."""
    if not installed("torch"):
        return []
    import attnexport  # noqa: F401  (registers the backends)
    from attnexport.custom_ops import registered_backends

    report = []
    for backend in registered_backends():
        reason = backend.unavailable_reason()
        report.append(
            {
                "name": backend.name,
                "priority": backend.priority,
                "available": reason is None,
                "unavailable_reason": reason,
                "capabilities": dict(backend.capabilities.as_rows()),
                "notes": list(backend.capabilities.notes),
            }
        )
    return report


def torch_reason() -> str | None:
    """Why the torch executor's backends are not listed, or None when torch is installed."""
    if installed("torch"):
        return None
    return f'torch is not installed (a deployment install): pip install "attnexport[{TORCH_EXTRA}]"'


def run(args: argparse.Namespace) -> int:
    from attnexport import ort_kernels

    report = backend_report()
    kernels = ort_kernels.status()
    if args.json:
        print(
            json.dumps(
                {
                    "backends": report,
                    "torch_unavailable_reason": torch_reason(),
                    "onnxruntime_kernels": kernels,
                },
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if report:
        _print_table(console, report)
    if torch_reason() is not None:
        console.print(f"[yellow]torch executor backends[/]: {escape(torch_reason())}")
    if kernels["available"]:
        console.print(
            f"onnxruntime executor: [green]native kernels[/] ({kernels['isa']}): "
            f"{escape(kernels['path'])}"
        )
    else:
        console.print(
            "onnxruntime executor: [yellow]function bodies[/] (native kernels unavailable: "
            f"{escape(kernels['unavailable_reason'])})"
        )
    return 0


def _print_table(console, report: list[dict]) -> None:
    """The capability matrix of the torch executor's backends, and why one is unavailable."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="attnexport kernel backends (auto picks the first that can run a call)")
    table.add_column("feature")
    for entry in report:
        status = "available" if entry["available"] else "unavailable"
        table.add_column(f"{entry['name']}\n({status})")
    for feature in report[0]["capabilities"]:
        table.add_row(feature, *(str(e["capabilities"][feature]) for e in report))
    console.print(table)
    for entry in report:
        if not entry["available"]:
            # Reasons contain brackets ("attnexport[ipex]") that rich would read as markup.
            console.print(f"[yellow]{entry['name']}[/]: {escape(entry['unavailable_reason'])}")
        for note in entry["notes"]:
            console.print(f"[dim]{entry['name']}: {escape(note)}[/]")
