"""The zoo ships inside the package: ``models/`` at the repository root is installed as
``attnexport.models`` and never as a top-level ``models`` package (which a user's own
``models.py`` or ``models/`` would shadow, or be shadowed by)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZOO_MODULES = sorted(p.name for p in (ROOT / "models").glob("*.py"))


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
    assert "attnexport.models" in packages
    assert all(p == "attnexport" or p.startswith("attnexport.") for p in packages), packages


def test_the_wheel_has_attnexport_models_and_no_top_level_models(tmp_path):
    """Builds the wheel from a copy of the tracked files (the tree itself gets no build/)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    pytest.importorskip("pip")
    _require_build_backend()
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    source = tmp_path / "source"
    for name in filter(None, (f.decode() for f in files)):
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).exists() or (ROOT / name).is_symlink():
            shutil.copy2(ROOT / name, target, follow_symlinks=False)
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    built = subprocess.run(
        [*pip_wheel, "--no-index", "-q", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("attnexport-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"attnexport"}, top_level
    shipped = sorted(n.removeprefix("attnexport/models/") for n in names if "/models/" in n)
    assert shipped == ZOO_MODULES
