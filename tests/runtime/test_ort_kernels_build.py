"""The native kernel library builds for every x86-64 CPU, not only the one that runs the suite.

``make`` builds it with ``-march=native``; a machine without AVX-512 compiles the 16-float
vectors differently (g++ warns there that returning them "changes the ABI", and the build's
``-Werror`` made that an error). Each build here is ``-O0`` (the warnings do not depend on
optimization; ~4 s instead of ~17 s) into a temporary file, with the build script's own flags.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The header the build script uses: the ORT_INCLUDE the user gave, else the one it unpacked.
HEADERS = Path(
    os.environ.get("ORT_INCLUDE")
    or ROOT / "build" / "ort-headers" / "usr" / "include" / "onnxruntime"
)

pytestmark = [
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 target flags"),
    pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed"),
    pytest.mark.skipif(
        not (HEADERS / "onnxruntime_c_api.h").is_file(),
        reason="onnxruntime headers not unpacked yet (make or scripts/build_ort_kernels.sh)",
    ),
]


@pytest.mark.parametrize("arch", ["x86-64", "x86-64-v3"], ids=["baseline", "avx2"])
def test_kernel_library_builds_without_avx512(tmp_path, arch):
    output = tmp_path / "libattnexport_ort.so"
    env = dict(os.environ, ARCH_FLAGS=f"-march={arch}", EXTRA_FLAGS="-O0", OUTPUT=str(output))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_ort_kernels.sh")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert output.is_file() and output.stat().st_size > 0
