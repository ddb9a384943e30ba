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
