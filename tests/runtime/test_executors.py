"""Greedy generation is identical across executors (eager module, loaded .pt2, onnxruntime)
and attention backends."""

from __future__ import annotations

import pytest
import torch

from attnexport.custom_ops import registered_backends
from attnexport.runtime import CacheConfig, Engine, SamplingParams, SchedulerConfig, TorchExecutor
from models import load_model

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 2], list(range(20, 45)), [7, 7, 1, 90, 33]]
PARAMS = SamplingParams(max_tokens=10)
CACHE = CacheConfig(num_blocks=48)
LIMITS = SchedulerConfig(max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def model():
    return load_model("llama")


@pytest.fixture(scope="module")
def eager_tokens(model) -> list[list[int]]:
    engine = Engine(TorchExecutor(model, block_size=BLOCK_SIZE, backend="sdpa"), CACHE, LIMITS)
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def pt2_path(model, tmp_path_factory):
    sample = model.export_sample(block_size=BLOCK_SIZE)
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    torch.export.save(sample.export(model), path)
    return path


def test_loaded_pt2_matches_eager(pt2_path, model, eager_tokens):
    executor = TorchExecutor(pt2_path)
    assert executor.cache_spec == model.cache_spec(BLOCK_SIZE)
    assert executor.vocab_size == model.config.vocab_size
    engine = Engine(executor, CACHE, LIMITS)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens


@pytest.mark.parametrize("name", ["ipex", "xformers"])
def test_other_backends_match_sdpa(name, model, eager_tokens):
    backend = next((b for b in registered_backends() if b.name == name), None)
    if backend is None:
        pytest.skip(f"{name}: backend not registered in this build")
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    device = "cpu" if "cpu" in backend.capabilities.devices else "cuda"
    executor = TorchExecutor(model, block_size=BLOCK_SIZE, backend=name, device=device)
    engine = Engine(executor, CACHE, LIMITS)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens


def test_executor_arguments_are_checked(model):
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        TorchExecutor(model, backend="nope")
    with pytest.raises(ValueError, match=r"no such \.pt2 file"):
        TorchExecutor("/nonexistent/model.pt2")
    with pytest.raises(TypeError, match=r"model: expected an nn\.Module"):
        TorchExecutor(42)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA device"):
            TorchExecutor(model, device="cuda")
