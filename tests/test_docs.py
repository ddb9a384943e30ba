"""The Python examples in README.md and docs/ run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks():
    for path in DOCS:
        if not path.exists():
            continue
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
        for i, block in enumerate(blocks):
            yield pytest.param(block, id=f"{path.name}-{i}")


@pytest.mark.parametrize("source", list(_python_blocks()))
def test_python_example_runs(source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(source, "<doc example>", "exec"), {"__name__": "__doc_example__"})


def _cli_lines():
    for path in DOCS:
        if not path.exists():
            continue
        for block in re.findall(r"```(?:bash|console|sh)\n(.*?)```", path.read_text(), flags=re.S):
            for line in block.splitlines():
                line = line.split(" #")[0].strip().removeprefix("$ ")
                if line.startswith("attnexport "):
                    yield pytest.param(line, id=f"{path.name}: {line[:60]}")


@pytest.mark.parametrize("line", list(_cli_lines()))
def test_documented_command_lines_parse(line):
    """Every ``attnexport ...`` line in the docs is accepted by the CLI's parser."""
    import shlex

    from attnexport.cli.main import build_parser

    build_parser().parse_args(shlex.split(line)[1:])
