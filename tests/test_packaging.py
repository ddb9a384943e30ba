"""The wheel the package build makes (``pip wheel .``, as a packager or a user would): a platform
wheel holding the native kernel library, every module of the package and nothing else; and,
where the library cannot be built, a wheel without it that says why at run time.

The build runs on a copy of the checkout's files (``git ls-files``: what a clean clone has, plus
new files) so that it neither writes into the checkout nor picks up its build leftovers, with
the onnxruntime header the kernel build test uses, and ``-O0`` (the contents do not depend on
optimization; ~10 s instead of ~60 s).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADERS = Path(
    os.environ.get("ORT_INCLUDE_DIR")
    or os.environ.get("ORT_INCLUDE")
    or ROOT / "build" / "ort-headers" / "usr" / "include" / "onnxruntime"
)
KERNELS = "attnexport/ort_kernels/"


def _setuptools_builds_wheels() -> bool:
    """pyproject's build-system (setuptools >= 70.1, which has bdist_wheel) in this venv: the
    build runs without isolation, i.e. without fetching it."""
    try:
        import setuptools.command.bdist_wheel  # noqa: F401
    except ImportError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(shutil.which("git") is None, reason="git lists the checkout's files"),
    pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout"),
    pytest.mark.skipif(
        not _setuptools_builds_wheels(), reason="the build needs setuptools >= 70.1 in this venv"
    ),
]


def _checkout_copy(destination: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        source, target = ROOT / name, destination / name
        if not source.exists() and not source.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        else:
            shutil.copy2(source, target)
    return destination


def _pip_wheel(tmp: Path, include_dir: Path, **env) -> tuple[subprocess.CompletedProcess, Path]:
    source = _checkout_copy(tmp / "source")
    out = tmp / "wheels"
    env = {**os.environ, "ORT_INCLUDE_DIR": str(include_dir), "EXTRA_FLAGS": "-O0", **env}
    command = [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet"]
    done = subprocess.run(
        [*command, "--no-build-isolation", "--wheel-dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    return done, out


def _build_wheel(tmp: Path, include_dir: Path) -> Path:
    done, out = _pip_wheel(tmp, include_dir, ATTNEXPORT_BUILD_REQUIRE_KERNELS="0")
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        pytest.skip("the kernels build with g++ for x86-64")
    if not (HEADERS / "onnxruntime_c_api.h").is_file():
        pytest.skip("onnxruntime headers not unpacked yet (make or scripts/build_ort_kernels.sh)")
    return _build_wheel(tmp_path_factory.mktemp("wheel"), HEADERS)


def _package_modules() -> set[str]:
    """The package's modules as the wheel names them (``models/`` is ``attnexport/models/``)."""
    names = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "attnexport", "models"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return {
        name if name.startswith("attnexport/") else f"attnexport/{name}"
        for name in names
        if name.endswith(".py") and (ROOT / name).exists()
    }


def test_the_wheel_is_a_platform_wheel_for_any_python(wheel):
    assert wheel.name.endswith("-py3-none-linux_x86_64.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{wheel.name.split('-py3')[0]}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in metadata
    assert "Tag: py3-none-linux_x86_64" in metadata


def test_the_wheel_holds_the_kernel_library_and_every_module_only(wheel, tmp_path):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        dist_info = next(n.split("/")[0] for n in names if ".dist-info/" in n)
        top_level = archive.read(f"{dist_info}/top_level.txt").decode().split()
        archive.extractall(tmp_path, [n for n in names if n.endswith(".so")])
    package = {n for n in names if not n.startswith(dist_info)}
    assert top_level == ["attnexport"]
    assert {n.split("/")[0] for n in package} == {"attnexport"}, "a top-level package besides it"
    assert _package_modules() <= package
    # Besides the modules: the library and its two variants, no sources or build leftovers.
    assert package - _package_modules() == {
        f"{KERNELS}libattnexport_ort.so",
        f"{KERNELS}libattnexport_ort_avx2.so",
        f"{KERNELS}libattnexport_ort_avx512.so",
    }
    library = ctypes.CDLL(str(tmp_path / KERNELS / "libattnexport_ort.so"))
    library.AttnexportKernelIsa.restype = ctypes.c_char_p
    assert library.AttnexportKernelIsa().decode() in ("avx512", "avx2")
    assert library.RegisterCustomOps


def test_without_the_header_the_wheel_builds_and_says_why_at_run_time(tmp_path):
    """The wheel installs without the kernels; `backends`' status and a model's run (a warning
    on stderr, once, and `describe()`) give the build's reason."""
    wheel = _build_wheel(tmp_path, tmp_path / "no-headers")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "installed")
    assert not [name for name in names if name.endswith(".so")]
    assert f"{KERNELS}build-failure.txt" in names
    code = (
        "import json; from attnexport import ort_kernels; print(json.dumps(ort_kernels.status()))"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "installed")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,  # not the checkout, whose package `-c` would import first
        check=True,
    )
    status = json.loads(done.stdout)
    assert status["available"] is False and status["path"] is None
    assert "was not built with attnexport" in status["unavailable_reason"]
    reason = status["unavailable_reason"]
    assert f"ORT_INCLUDE_DIR={tmp_path / 'no-headers'} holds no onnxruntime_c_api.h" in reason

    # A model then runs on the function bodies: said once per process, on stderr, with why.
    from attnexport.artifact import ExportOptions, export_artifact

    export_artifact("zoo:llama", tmp_path / "llama", ExportOptions(formats=("onnx",)))
    code = (
        "import sys; from attnexport.runtime import Engine; "
        "engines = [Engine.from_path(sys.argv[1]) for _ in range(2)]; "
        "print(engines[0].describe())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "llama")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        check=True,
    )
    warning = "attnexport: warning: the native onnxruntime kernels are unavailable"
    assert done.stderr.count(warning) == 1, done.stderr
    assert "holds no onnxruntime_c_api.h" in done.stderr and "instead of 143" in done.stderr
    assert "bodies kernels; native kernels unavailable:" in done.stdout


def test_a_build_that_requires_the_kernels_fails_without_them(tmp_path):
    """ATTNEXPORT_BUILD_REQUIRE_KERNELS=1 (a release or CI build) makes a kernel build failure
    fail the package build instead of shipping a wheel that runs on the function bodies."""
    done, out = _pip_wheel(tmp_path, tmp_path / "no-headers", ATTNEXPORT_BUILD_REQUIRE_KERNELS="1")
    assert done.returncode != 0 and not list(out.glob("*.whl"))
    assert "the native onnxruntime kernels were not built" in done.stderr + done.stdout
