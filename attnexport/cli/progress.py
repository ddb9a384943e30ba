"""Progress display for long CLI steps (rich status spinner on stderr)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def steps(quiet: bool = False) -> Iterator[Callable[[str], None]]:
    """Yields ``step(description)``: each call ends the previous step (printing its time) and
    shows a spinner for the new one. Output goes to stderr, so ``--json`` stdout stays clean."""
    if quiet:
        yield lambda _description: None
        return
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    current: list = [None, 0.0]

    def finish() -> None:
        if current[0] is not None:
            elapsed = time.perf_counter() - current[1]
            console.print(f"[dim]  {escape(current[0])} ({elapsed:.1f} s)[/]")

    with console.status("") as status:

        def step(description: str) -> None:
            finish()
            current[0], current[1] = description, time.perf_counter()
            status.update(f"{escape(description)}...")

        yield step
    finish()
