"""``attnexport backends``: which kernel backends exist, run here, and what they support."""

from __future__ import annotations

import argparse
import json


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "backends", help="list kernel backends, their availability and capabilities"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def backend_report() -> list[dict]:
    """One dict per registered backend: name, priority, availability, reason, capabilities."""
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


def run(args: argparse.Namespace) -> int:
    report = backend_report()
    if args.json:
        print(json.dumps({"backends": report}, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    table = Table(title="attnexport kernel backends (auto picks the first that can run a call)")
    table.add_column("feature")
    for entry in report:
        status = "available" if entry["available"] else "unavailable"
        table.add_column(f"{entry['name']}\n({status})")
    for feature in report[0]["capabilities"] if report else []:
        table.add_row(feature, *(str(e["capabilities"][feature]) for e in report))
    console.print(table)
    for entry in report:
        if not entry["available"]:
            # Reasons contain brackets ("attnexport[ipex]") that rich would read as markup.
            console.print(f"[yellow]{entry['name']}[/]: {escape(entry['unavailable_reason'])}")
        for note in entry["notes"]:
            console.print(f"[dim]{entry['name']}: {escape(note)}[/]")
    return 0
