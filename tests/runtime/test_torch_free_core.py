"""The serving core (engine, scheduler, block manager, sampler, sequences, outputs, text,
config, model inputs, the onnxruntime executor) imports neither torch nor the ops layer nor the
lowering, and generates with onnxruntime in a process where torch cannot be imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runtime.test_executors import (  # noqa: F401  (fixtures)
    BLOCK_SIZE,
    CACHE,
    LIMITS,
    PARAMS,
    PROMPTS,
    eager_tokens,
    exports,
    model,
    onnx_path,
)

SERVING_CORE = [
    "attnexport.runtime",
    "attnexport.runtime.engine",
    "attnexport.runtime.scheduler",
    "attnexport.runtime.block_manager",
    "attnexport.runtime.sampling",
    "attnexport.runtime.sequence",
    "attnexport.runtime.outputs",
    "attnexport.runtime.text",
    "attnexport.runtime.config",
    "attnexport.runtime.model_input",
    "attnexport.runtime.loading",
    "attnexport.runtime.request_checks",
    "attnexport.runtime.output_processor",
    "attnexport.runtime.step_packing",
    "attnexport.runtime.executors.base",
    "attnexport.runtime.executors.cache_pool",
    "attnexport.runtime.executors.ort_executor",
    "attnexport.runtime.embedding",
    "attnexport.runtime.logprobs",
    "attnexport.runtime.logits_processing",
    "attnexport.runtime.structured_output",
]
FORBIDDEN = ("torch", "attnexport.custom_ops", "attnexport.lowering", "onnx")

# Run in a fresh interpreter: torch is made unimportable before anything is imported.
_PRELUDE = """
import json, sys
sys.modules["torch"] = None
"""


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + code], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _loaded(prefixes: tuple[str, ...]) -> str:
    return (
        "[m for m, v in sys.modules.items() if v is not None and any("
        f"m == p or m.startswith(p + '.') for p in {prefixes!r})]"
    )


def test_the_serving_core_imports_without_torch_the_ops_or_the_lowering():
    out = _run(
        "import importlib\n"
        f"for name in {SERVING_CORE!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps({_loaded(FORBIDDEN)}))\n"
    )
    assert json.loads(out) == []


def test_torch_executor_is_the_one_name_that_needs_torch():
    out = _run(
        "import attnexport.runtime as runtime\n"
        "try:\n"
        "    runtime.TorchExecutor\n"
        "except ImportError as error:\n"
        "    print(json.dumps(type(error).__name__))\n"
    )
    assert json.loads(out) in ("ImportError", "ModuleNotFoundError")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_onnxruntime_generates_without_torch(onnx_path, eager_tokens, mode):  # noqa: F811
    """Greedy tokens from the OrtExecutor in a torch-free process are the eager model's
    (with a pool small enough to preempt: swaps and recomputations run on NumPy caches)."""
    out = _run(
        "from attnexport.runtime import CacheConfig, Engine, OrtExecutor, SamplingParams\n"
        "from attnexport.runtime import SchedulerConfig\n"
        f"executor = OrtExecutor({str(onnx_path)!r}, num_threads=1)\n"
        "engine = Engine(executor, CacheConfig(num_blocks=12, num_cpu_blocks=48),\n"
        "    SchedulerConfig(max_model_len=48,\n"
        f"    max_num_batched_tokens={LIMITS.max_num_batched_tokens},\n"
        f"    preemption_mode={mode!r}))\n"
        f"outputs = engine.generate({PROMPTS!r}, SamplingParams(max_tokens={PARAMS.max_tokens}))\n"
        "print(json.dumps([[o.token_ids for o in outputs], engine.stats.num_preemptions]))\n"
        f"assert {_loaded(FORBIDDEN)} == []\n"
    )
    tokens, preemptions = json.loads(out)
    assert tokens == eager_tokens
    assert preemptions > 0
