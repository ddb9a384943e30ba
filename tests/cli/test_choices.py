"""Every choice list of the command line is its registry's: a backend, target, dtype, executor
or device added there reaches the flags without a second list to keep in step."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnexport.artifact import DTYPE_NAMES, EXECUTOR_FORMAT, MODEL_FILES
from attnexport.cli.bench_cmd import BENCHMARKS
from attnexport.cli.main import build_parser
from attnexport.custom_ops import registered_backends
from attnexport.lowering import TARGETS
from attnexport.models import zoo_names
from attnexport.runtime.executors.ort_executor import PROVIDERS


def _action(command: str, flag: str) -> argparse.Action:
    """The argparse action of ``flag`` (an option or a positional's name) of ``command``."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = commands.choices[command]
    return next(a for a in sub._actions if flag in a.option_strings or a.dest == flag)


def _choices(command: str, flag: str) -> list[str]:
    return list(_action(command, flag).choices)


@pytest.mark.parametrize(
    "command,flag,registry",
    [
        ("export", "--format", lambda: [*MODEL_FILES, "both"]),
        ("export", "--target", lambda: list(TARGETS)),
        ("export", "--dtype", lambda: list(DTYPE_NAMES)),
        ("run", "--executor", lambda: ["auto", *EXECUTOR_FORMAT]),
        ("run", "--backend", lambda: ["auto", *(b.name for b in registered_backends())]),
        ("run", "--device", lambda: list(PROVIDERS)),
        ("bench", "name", lambda: list(BENCHMARKS)),
    ],
)
def test_cli_choices_are_the_registries(command, flag, registry):
    assert _choices(command, flag) == registry()


@pytest.mark.parametrize("command,flag", [("export", "model"), ("demo", "--model")])
def test_model_help_lists_the_zoo(command, flag):
    assert all(name in _action(command, flag).help for name in zoo_names())


def test_building_the_parser_loads_neither_the_lowering_nor_onnxruntime():
    """The slow registries are read when a flag is checked or ``--help`` is written, so that
    every command (``backends``, ``--version``) starts without importing them."""
    code = (
        "import sys; from attnexport.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in ('attnexport.lowering', 'onnxruntime') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
