"""The zoo ships inside the package: ``models/`` at the repository root is installed as
``attnexport.models`` and never as a top-level ``models`` package (which a user's own
``models.py`` or ``models/`` would shadow, or be shadowed by). The built wheel's contents
(``attnexport/models/...`` and no other top-level package) are checked by
``tests/test_packaging.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _require_build_backend() -> None:
    """Skips where the build requirements of pyproject.toml are not installed (the builds here
    run without network, against the installed setuptools)."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 68:
        pytest.skip(f"pyproject.toml requires setuptools>=68, found {setuptools.__version__}")
    try:  # bdist_wheel: part of setuptools since 70.1, else the wheel package
        import setuptools.command.bdist_wheel
    except ImportError:
        pytest.importorskip("wheel")


def _discovered_packages() -> list[str]:
    """The packages setuptools' discovery finds with the project's pyproject.toml."""
    _require_build_backend()
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    cwd = Path.cwd()
    os.chdir(ROOT)  # discovery is relative to the project root
    try:
        return apply_configuration(Distribution(), ROOT / "pyproject.toml").packages
    finally:
        os.chdir(cwd)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_discovery_installs_the_zoo_only_as_attnexport_models():
    packages = _discovered_packages()
    assert "attnexport.models" in packages and "attnexport.models.generic" in packages
    assert all(p == "attnexport" or p.startswith("attnexport.") for p in packages), packages
