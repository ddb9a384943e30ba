"""The scripts of ``benchmarks/`` as modules for the tests that check them (benchmarks/ is not
a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py``, executed afresh (a script may read the environment when it is
    imported) and registered as ``attnexport_bench_NAME`` in ``sys.modules``, where dataclasses
    look their module up. The folder is on ``sys.path`` while it loads, for a script that
    imports a sibling (``serve.py`` imports ``generate.py``)."""
    key = f"attnexport_bench_{name}"
    spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
