"""The native kernel library builds whatever target flags the compiler is given besides the
build's own (ARCH_FLAGS, for development builds), not only on the CPU that runs the suite, and
those flags never raise its variants above their ISA.

The library holds an AVX2 and an AVX-512 variant (scripts/build_ort_kernels.sh); compiled for
AVX2, g++ warns that returning the 16-float vectors "changes the ABI", and the build's
``-Werror`` once made that an error on machines without AVX-512. Each build here is ``-O0``
(the warnings do not depend on optimization; seconds instead of ~20 s) into a temporary file,
with the build script's own flags.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.real_model import slow_param

ROOT = Path(__file__).resolve().parents[2]
# The header the build script uses: the directory the user gave, else the one it unpacked.
HEADERS = Path(
    os.environ.get("ORT_INCLUDE_DIR")
    or os.environ.get("ORT_INCLUDE")
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


def _instructions(library: Path) -> str:
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(library)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


# The output's name per -march: the default name, and others (the variants are named after it).
OUTPUTS = {"x86-64": "libattnexport_ort.so", "x86-64-v3": "base.so", "native": "dev.so"}
# -march=native raises every ISA flag of the CPU (AVX-512 here where it has it, else AVX2)
_NATIVE_COVERS = "-march=native covers it (and make builds the baseline itself, at -O3)"


@pytest.mark.parametrize(
    "arch",
    [slow_param("x86-64", _NATIVE_COVERS), slow_param("x86-64-v3", _NATIVE_COVERS), "native"],
    ids=["baseline", "avx2", "native"],
)
def test_kernel_library_builds_without_avx512(tmp_path, arch):
    name = OUTPUTS[arch]
    output = tmp_path / name
    env = dict(os.environ, ARCH_FLAGS=f"-march={arch}", EXTRA_FLAGS="-O0", OUTPUT=str(output))
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_ort_kernels.sh")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert output.is_file() and output.stat().st_size > 0
    # The ISA variants are written beside it, under its name, and it finds them there.
    stem = output.with_suffix("")
    variants = [Path(f"{stem}_avx2.so"), Path(f"{stem}_avx512.so")]
    assert all(variant.is_file() for variant in variants)
    library = ctypes.CDLL(str(output))
    library.AttnexportKernelIsa.restype = ctypes.c_char_p
    assert library.AttnexportKernelIsa().decode() in ("avx2", "avx512")
    # Whatever ARCH_FLAGS says (-march=native on an AVX-512 machine), the AVX2 library holds no
    # AVX-512 register and the dispatcher no AVX one: they run on CPUs without them.
    if shutil.which("objdump"):
        assert "%zmm" not in _instructions(variants[0])
        dispatcher = _instructions(output)
        assert "%ymm" not in dispatcher and "%zmm" not in dispatcher
