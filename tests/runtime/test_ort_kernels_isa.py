"""The native kernel library's two variants: AVX-512 where the CPU has it, AVX2 otherwise or when
``ATTNEXPORT_ISA=avx2`` forces it. Both run a real model here (each in its own process: the
variable is read when onnxruntime registers the library) and agree with each other and with
the function bodies; a forced variant that cannot run is a named error, never the bodies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from attnexport import ort_kernels
from tests.helpers import cpu_flags, requires_ort_kernels

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 2], list(range(20, 45))]

pytestmark = requires_ort_kernels

# Generates with the OrtExecutor and saves the logits of every step.
GENERATE = r"""
import json, re, sys
import numpy as np
from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams

model, kernels, out = sys.argv[1:4]  # and the prompts as JSON
executor = OrtExecutor(model, num_threads=1, kernels=kernels)
steps = []
execute = executor.execute_numpy

def recording(model_input):
    logits = execute(model_input)
    steps.append(np.array(logits, copy=True))
    return logits

executor.execute_numpy = recording
engine = Engine(executor, CacheConfig(num_blocks=160))
outputs = engine.generate(json.loads(sys.argv[4]), SamplingParams(max_tokens=6))
np.save(out, np.concatenate(steps))
with open("/proc/self/maps") as maps:
    mapped = sorted(set(re.findall(r"libattnexport_ort\w*\.so", maps.read())))
print(json.dumps({"isa": executor.kernel_isa, "describe": executor.describe(),
                  "tokens": [o.token_ids for o in outputs], "mapped": mapped}))
"""


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory) -> Path:
    from attnexport.artifact import ExportOptions, export_artifact

    out = tmp_path_factory.mktemp("isa") / "llama"
    export_artifact("zoo:llama", out, ExportOptions(formats=("onnx",)))
    return out / "model.onnx"


def _generate(model: Path, kernels: str, out: Path, isa: str | None) -> tuple[dict, np.ndarray]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ort_kernels.ISA_VARIABLE, None)
    if isa is not None:
        env[ort_kernels.ISA_VARIABLE] = isa
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, str(model), kernels, str(out), json.dumps(PROMPTS)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout), np.load(out)


def _cpu_has_avx512() -> bool:
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def test_the_default_variant_is_the_widest_the_cpu_runs(monkeypatch):
    monkeypatch.delenv(ort_kernels.ISA_VARIABLE, raising=False)
    assert ort_kernels.kernel_isa() == ("avx512" if _cpu_has_avx512() else "avx2")
    monkeypatch.setenv(ort_kernels.ISA_VARIABLE, "avx2")
    assert ort_kernels.kernel_isa() == "avx2"
    assert ort_kernels.status() == {
        "available": True,
        "path": str(ort_kernels.LIBRARY),
        "isa": "avx2",
        "unavailable_reason": None,
    }


@pytest.mark.skipif(not _cpu_has_avx512(), reason="this CPU has no AVX-512: one variant runs")
def test_both_variants_run_and_agree_with_each_other_and_the_bodies(onnx_model, tmp_path):
    avx512, avx512_logits = _generate(onnx_model, "native", tmp_path / "avx512.npy", None)
    avx2, avx2_logits = _generate(onnx_model, "native", tmp_path / "avx2.npy", "avx2")
    bodies, bodies_logits = _generate(onnx_model, "bodies", tmp_path / "bodies.npy", None)
    assert (avx512["isa"], avx2["isa"], bodies["isa"]) == ("avx512", "avx2", None)
    # Only the chosen variant is loaded: AVX-512 code is never mapped where AVX2 runs.
    assert avx512["mapped"] == ["libattnexport_ort.so", "libattnexport_ort_avx512.so"]
    assert avx2["mapped"] == ["libattnexport_ort.so", "libattnexport_ort_avx2.so"]
    assert "native kernels (avx2)" in avx2["describe"]
    assert "native kernels (avx512)" in avx512["describe"]
    assert avx512["tokens"] == avx2["tokens"] == bodies["tokens"]
    assert avx512_logits.shape == avx2_logits.shape == bodies_logits.shape
    # The variants differ in vector width (summation order): equal to float32 rounding.
    np.testing.assert_allclose(avx2_logits, avx512_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(avx2_logits, bodies_logits, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "value,message",
    [
        ("avx1024", r"ATTNEXPORT_ISA='avx1024': expected one of \('avx2', 'avx512'\)"),
        ("AVX2", r"ATTNEXPORT_ISA='AVX2': expected one of"),
    ],
)
def test_a_bad_forced_isa_is_a_named_error_not_the_bodies(onnx_model, monkeypatch, value, message):
    from attnexport.runtime import OrtExecutor

    monkeypatch.setenv(ort_kernels.ISA_VARIABLE, value)
    with pytest.raises(ort_kernels.KernelIsaError, match=message):
        OrtExecutor(onnx_model, num_threads=1)
    # The library itself refuses it too (a session that registers it directly).
    assert ort_kernels.kernel_isa().startswith(f"unsupported: ATTNEXPORT_ISA={value}: expected")
    # Running the bodies on purpose needs no kernels: the variable is not read.
    assert OrtExecutor(onnx_model, num_threads=1, kernels="bodies").kernels == "bodies"


def test_the_variants_are_found_beside_the_library_and_a_missing_one_is_named(
    tmp_path, monkeypatch
):
    """The registered library loads its variants from its own directory (wherever the package
    is installed) and reports a missing one by its path instead of failing a session."""
    import ctypes
    import shutil

    shutil.copy(ort_kernels.LIBRARY, tmp_path / ort_kernels.LIBRARY.name)
    shutil.copy(ort_kernels.LIBRARY.with_name("libattnexport_ort_avx2.so"), tmp_path)
    library = ctypes.CDLL(str(tmp_path / ort_kernels.LIBRARY.name))
    library.AttnexportKernelIsa.restype = ctypes.c_char_p
    monkeypatch.setenv(ort_kernels.ISA_VARIABLE, "avx2")
    assert library.AttnexportKernelIsa().decode() == "avx2"
    if _cpu_has_avx512():
        monkeypatch.delenv(ort_kernels.ISA_VARIABLE)
        assert library.AttnexportKernelIsa().decode() == (
            f"unsupported: {tmp_path}/libattnexport_ort_avx512.so is missing (an incomplete "
            "build or install)"
        )
