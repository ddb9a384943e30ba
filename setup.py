"""The package build's one step beyond pyproject.toml: the native onnxruntime kernels.

``pip install .``, ``pip wheel .`` and ``python -m build`` compile
``attnexport/ort_kernels/libattnexport_ort*.so`` into the wheel with
``scripts/build_ort_kernels.sh`` (the one home of that build: the header's sources, the ISA
variants, the flags), so the wheel is a platform wheel, ``py3-none-linux_x86_64``: the library
is an onnxruntime plugin, not a CPython extension, so one wheel serves every Python version.
Where the library cannot be built (no compiler, no onnxruntime header, not x86-64), the wheel is
built without it and carries the reason in ``ort_kernels/build-failure.txt``, which
``attnexport backends`` and the onnxruntime executor report at run time.

An editable install (``pip install -e .``, what ``make`` does) builds nothing: ``make`` builds
the library next to the sources.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from setuptools import Distribution, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
KERNELS = Path("attnexport", "ort_kernels")
LIBRARY = "libattnexport_ort.so"
FAILURE = "build-failure.txt"


class BuildPyWithKernels(build_py):
    """``build_py``, then the kernel library (or the reason there is none) into ``build_lib``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / KERNELS
        target.mkdir(parents=True, exist_ok=True)
        for stale in [*target.glob("*.so"), target / FAILURE]:  # an earlier build's
            stale.unlink(missing_ok=True)
        # Shipped: no development tuning, and a compiler's new warning is not a failure.
        env = {k: v for k, v in os.environ.items() if k != "ARCH_FLAGS"}
        env |= {"OUTPUT": str((target / LIBRARY).resolve()), "WERROR": "0"}
        done = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build_ort_kernels.sh")],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            self.announce(f"built {target / LIBRARY}", level=2)
            return
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"build_ort_kernels.sh exited {done.returncode}"
        if os.environ.get("ATTNEXPORT_BUILD_REQUIRE_KERNELS") == "1":  # a release or CI build
            raise RuntimeError(f"the native onnxruntime kernels were not built:\n{done.stderr}")
        (target / FAILURE).write_text(reason.removeprefix("build_ort_kernels.sh: ") + "\n")
        self.warn(f"the native onnxruntime kernels were not built: {reason}")


class BinaryDistribution(Distribution):
    """A distribution with a native library: installed to platlib, wheel not pure."""

    def has_ext_modules(self) -> bool:
        return True


class PlatformWheel(bdist_wheel):
    """A wheel tagged for this platform (it holds a native library) but no Python ABI."""

    def get_tag(self) -> tuple[str, str, str]:
        return "py3", "none", super().get_tag()[2]


setup(
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel},
)
