"""Greedy generation is identical across executors (eager module, loaded .pt2, onnxruntime)
and attention backends."""

from __future__ import annotations

import contextlib
import itertools
import shutil

import numpy as np
import pytest
import torch

from attnexport import ort_kernels
from attnexport.custom_ops import registered_backends
from attnexport.errors import UserError
from attnexport.models import load_model
from attnexport.runtime import (
    CacheConfig,
    Engine,
    SamplingParams,
    SchedulerConfig,
    TorchExecutor,
)
from tests.helpers import ORT_KERNEL_MODES
from tests.models.executors import Exports, write_exports

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
def exports(model, tmp_path_factory) -> Exports:
    return write_exports(model, BLOCK_SIZE, tmp_path_factory.mktemp("exports"))


@pytest.fixture(scope="module")
def pt2_path(exports):
    return exports.pt2


@pytest.fixture(scope="module")
def onnx_path(exports):
    return exports.onnx


def test_onnx_model_has_one_node_per_attnexport_op_and_layer(onnx_path, model):
    """The split of the fused qkv projection with the rotation of q and k, the gated activation
    and each residual add with the norm after it are one fused node per layer (native kernel or
    body), beside the cache write and the attention (the first layer's input is the residual:
    its first norm adds nothing)."""
    import onnx

    graph = onnx.load(onnx_path, load_external_data=False).graph
    kinds = [n.op_type for n in graph.node if n.domain == "attnexport"]
    layers = model.config.num_hidden_layers
    per_layer = ["PagedAttention", "ReshapeAndCache", "NeoxQKVRotaryEmbedding", "SiluAndMul"]
    assert sorted(kinds) == sorted(per_layer * layers + ["FusedAddRMSNorm"] * (2 * layers))


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_onnxruntime_matches_eager(onnx_path, model, eager_tokens, kernels):
    from attnexport.runtime import OrtExecutor

    executor = OrtExecutor(onnx_path, num_threads=1, kernels=kernels)
    assert executor.kernels == kernels and f"{kernels} kernels" in executor.describe()
    assert executor.cache_spec == model.cache_spec(BLOCK_SIZE)
    assert executor.vocab_size == model.config.vocab_size
    engine = Engine(executor, CACHE, LIMITS)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens


@pytest.mark.parametrize("kernels", ORT_KERNEL_MODES)
def test_onnxruntime_updates_the_bound_caches_in_place(onnx_path, model, kernels):
    """Each cache is one OrtValue bound as input and as ``_out`` output: its buffer is the torch
    cache's, never changes across steps, is what onnxruntime returns as the output, and holds
    the keys/values the eager model writes."""
    from attnexport.runtime import OrtExecutor

    ort_engine = Engine(OrtExecutor(onnx_path, num_threads=1, kernels=kernels), CACHE, LIMITS)
    eager_engine = Engine(TorchExecutor(model, block_size=BLOCK_SIZE), CACHE, LIMITS)
    executor = ort_engine.executor
    values = executor.cache_ortvalues
    pointers = [v.data_ptr() for v in values]
    assert pointers == [c.ctypes.data for c in executor.kv_caches]
    before = [c.copy() for c in executor.kv_caches]
    for engine in (ort_engine, eager_engine):
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=4))
    for step in range(4):
        ort_engine.step()
        eager_engine.step()
        outputs = executor._binding.get_outputs()[1:]  # after the logits, in binding order
        assert [o.data_ptr() for o in outputs] == pointers, f"step {step}: a cache was copied"
        assert [v.data_ptr() for v in values] == pointers
    written = ort_engine.block_manager.num_used_blocks()
    assert written > 0
    eager_caches = eager_engine.executor.kv_caches
    for cache, old, eager in zip(executor.kv_caches, before, eager_caches, strict=True):
        assert not np.array_equal(cache, old)
        torch.testing.assert_close(torch.from_numpy(cache), eager, atol=1e-5, rtol=1e-5)


def _ort_run(onnx_path, fresh_inputs: bool) -> tuple[list, list, list]:
    """Generates PROMPTS with onnxruntime; returns the tokens, every step's logits and the names
    of the inputs bound. ``fresh_inputs``: every step binds new input buffers."""
    from attnexport.runtime import OrtExecutor

    engine = Engine(OrtExecutor(onnx_path, num_threads=1), CACHE, LIMITS)
    executor, logits, bound = engine.executor, [], []
    execute_numpy, bind = executor.execute_numpy, executor._binding.bind_ortvalue_input

    def record_bind(name, value):
        bound.append(name)
        bind(name, value)

    def record(model_input):
        if fresh_inputs:
            executor._input_buffers = {}
        result = execute_numpy(model_input)
        logits.append(result.copy())
        return result

    executor._binding.bind_ortvalue_input = record_bind
    executor.execute_numpy = record
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)], logits, bound


def test_onnxruntime_writes_bound_inputs_in_place_until_a_shape_changes(onnx_path):
    """A step whose inputs keep their shapes writes them into the buffers bound before (the
    batch and the block-table width change in this run: those steps bind new ones); every
    step's logits are exactly those of an executor that binds new buffers every step."""
    tokens, logits, bound = _ort_run(onnx_path, fresh_inputs=False)
    fresh_tokens, fresh_logits, fresh_bound = _ort_run(onnx_path, fresh_inputs=True)
    assert tokens == fresh_tokens
    assert len(logits) == len(fresh_logits)
    for step, (reused, fresh) in enumerate(zip(logits, fresh_logits, strict=True)):
        assert np.array_equal(reused, fresh), f"step {step}"
    assert len(fresh_bound) == 7 * len(logits)
    assert 7 < len(bound) < len(fresh_bound) / 2
    assert bound.count("block_tables") > 1  # the width grew: the table was bound again


def test_onnxruntime_logits_are_not_overwritten_while_held(onnx_path, eager_tokens):
    """A step's logits stay valid while anything refers to them (the array, a tensor made from
    it as ``execute`` returns, a row of it); the buffer of logits nobody kept is written again
    by the next step of the same shape. Tokens do not depend on which happens."""
    from attnexport.runtime import OrtExecutor

    engine = Engine(OrtExecutor(onnx_path, num_threads=1), CACHE, LIMITS)
    executor, held, addresses = engine.executor, [], []
    execute_numpy = executor.execute_numpy

    def keep_some(model_input):
        logits = execute_numpy(model_input)
        addresses.append(logits.ctypes.data)
        kept = (logits, torch.from_numpy(logits), logits[-1], None)[len(addresses) % 4]
        if kept is not None:
            held.append((kept, kept.copy() if isinstance(kept, np.ndarray) else kept.clone()))
        return logits

    executor.execute_numpy = keep_some
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens
    assert len(held) >= 9
    for kept, copy in held:
        assert kept.dtype in (np.float32, torch.float32) and kept.shape[-1] == executor.vocab_size
        assert (kept == copy).all()
    assert any(a == b for a, b in itertools.pairwise(addresses)), "no buffer was reused"


def test_onnxruntime_execute_returns_tensors_later_steps_keep(onnx_path):
    """``execute`` returns a torch tensor sharing the executor's buffer: holding it keeps the
    later steps from writing that buffer (replayed steps give the engine's logits)."""
    from attnexport.runtime import OrtExecutor

    engine = Engine(OrtExecutor(onnx_path, num_threads=1), CACHE, LIMITS)
    executor, steps = engine.executor, []
    execute_numpy = executor.execute_numpy

    def record(model_input):
        logits = execute_numpy(model_input)
        steps.append((model_input, logits.copy()))
        return logits

    executor.execute_numpy = record
    engine.generate(PROMPTS[:2], SamplingParams(max_tokens=3))
    replay = OrtExecutor(onnx_path, num_threads=1)
    replay.initialize_cache(engine.num_blocks, 0)
    returned = [replay.execute(model_input) for model_input, _ in steps]
    assert len(returned) >= 3
    for logits, (_, expected) in zip(returned, steps, strict=True):
        assert logits.dtype == torch.float32 and logits.shape[1] == executor.vocab_size
        assert torch.equal(logits, torch.from_numpy(expected))


def test_loaded_pt2_matches_eager(pt2_path, model, eager_tokens):
    executor = TorchExecutor(pt2_path)
    assert executor.cache_spec == model.cache_spec(BLOCK_SIZE)
    assert executor.vocab_size == model.config.vocab_size
    engine = Engine(executor, CACHE, LIMITS)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens


def _available_backend(name: str):
    backend = next((b for b in registered_backends() if b.name == name), None)
    if backend is None:
        pytest.skip(f"{name}: backend not registered in this build")
    reason = backend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return backend


@pytest.mark.parametrize("name", ["ipex", "xformers"])
def test_other_backends_match_sdpa(name, model, eager_tokens):
    """IPEX runs every step of this model; xFormers has no paged decode for a float32 cache of
    4-token blocks, so on CUDA it runs under ``auto`` (xFormers where it can, sdpa for the
    rest)."""
    backend = _available_backend(name)
    device = "cpu" if "cpu" in backend.capabilities.devices else "cuda"
    choice = name if device == "cpu" else "auto"
    executor = TorchExecutor(model, block_size=BLOCK_SIZE, backend=choice, device=device)
    engine = Engine(executor, CACHE, LIMITS)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens


@pytest.mark.parametrize(
    ("name", "options"),
    [
        # IPEX 2.8's kernels take a cache of the queries' dtype only
        ("ipex", {"kv_cache_dtype": torch.bfloat16}),
        # no xFormers operator reads a float32 cache of 4-token blocks in a decode batch
        ("xformers", {"device": "cuda"}),
    ],
    ids=["ipex-bf16-cache", "xformers-fp32-decode"],
)
def test_backend_that_cannot_run_the_model_is_refused_when_chosen(name, options, model):
    """A backend chosen by name that cannot run some step of the model is refused when the
    executor is made, naming the backend's reasons; it used to fail the first such step of a
    running engine, with every request in it."""
    _available_backend(name)
    with pytest.raises(UserError, match=rf"backend: '{name}' cannot run this model's steps"):
        TorchExecutor(model, block_size=BLOCK_SIZE, backend=name, **options)


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
    from attnexport.runtime import OrtExecutor

    with pytest.raises(ValueError, match=r"no such \.onnx file"):
        OrtExecutor("/nonexistent/model.onnx")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda'"):
        OrtExecutor("/nonexistent/model.onnx", device="meta")
    with pytest.raises(
        ValueError, match=r"kernels: expected one of \('auto', 'native', 'bodies'\)"
    ):
        OrtExecutor("/nonexistent/model.onnx", kernels="fused")
    with pytest.raises(ValueError, match="kernels='native': the attnexport kernels are CPU"):
        OrtExecutor("/nonexistent/model.onnx", device="cuda", kernels="native")


def test_engine_from_an_export_directory(pt2_path, eager_tokens, tmp_path):
    directory = tmp_path / "export"
    directory.mkdir()
    shutil.copyfile(pt2_path, directory / "model.pt2")  # a link in it would be refused
    (directory / "manifest.json").write_text('{"config": {"max_position_embeddings": 128}}')
    engine = Engine.from_path(directory, cache_config=CACHE, scheduler_config=SchedulerConfig())
    assert engine.max_model_len == 128 and engine.executor.name == "torch"
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens
    with pytest.raises(ValueError, match=r"has no model\.onnx for --executor ort"):
        Engine.from_path(directory, executor="ort")


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda d: d / "missing", "does not exist"),
        (lambda d: d, r"holds neither model\.onnx nor model\.pt2"),
        (lambda d: (d / "weights.bin").touch() or d / "weights.bin", "expected a .onnx or .pt2"),
    ],
)
def test_bad_artifacts_are_named(make, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        Engine.from_path(make(tmp_path))


def _executors(model, pt2_path, onnx_path) -> dict:
    from attnexport.runtime import OrtExecutor

    made = {
        "eager": TorchExecutor(model, block_size=BLOCK_SIZE, backend="sdpa"),
        "pt2": TorchExecutor(pt2_path, backend="sdpa"),
        **{
            f"ort-{kernels}": OrtExecutor(onnx_path, num_threads=1, kernels=kernels)
            for kernels in ("native", "bodies")
            if kernels == "bodies" or ort_kernels.unavailable_reason() is None
        },
    }
    for executor in made.values():
        executor.initialize_cache(8, 0)
    return made


BAD_ROWS = {
    "negative token id": ({"input_ids": [5, -1, 7]}, "input_ids: -1 is out of range"),
    "token id past the vocabulary": ({"input_ids": [5, 10**6, 7]}, "input_ids: 1000000"),
    "negative logits row": ({"logits_indices": [-1]}, "logits_indices: -1 is out of range"),
    "logits row past the tokens": ({"logits_indices": [3]}, r"logits_indices: 3 .*\[0, 3\)"),
    "negative position": ({"positions": [-3, 1, 2]}, "positions: -3 is out of range"),
}


@pytest.mark.parametrize("change,message", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_bad_token_rows_are_refused_before_running(change, message, model, pt2_path, onnx_path):
    """An embedding or row gather would wrap a negative index (onnxruntime's Gather, torch
    indexing) or raise a bare IndexError: every executor names the input first."""
    from attnexport.runtime.model_input import pack_decoder_step

    for name, executor in _executors(model, pt2_path, onnx_path).items():
        step = pack_decoder_step([0], [3], [[1]], [[5, 6, 7]], [1], BLOCK_SIZE)
        step.values.update(change)
        before = [torch.as_tensor(c).clone() for c in executor.kv_caches]
        with pytest.raises(ValueError, match=message):
            executor.execute_numpy(step)
        after = [torch.as_tensor(c) for c in executor.kv_caches]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), name


@pytest.mark.parametrize("source", ["eager", "pt2"])
def test_every_layer_reuses_the_step_plan(source, model, pt2_path, monkeypatch):
    """The executor's step plan owns the tensors the ops receive (also through a loaded .pt2
    program), so the layers after the first check and plan nothing."""
    from attnexport.runtime.executors import torch_executor
    from attnexport.runtime.model_input import pack_decoder_step

    source = model if source == "eager" else pt2_path
    executor = TorchExecutor(source, block_size=BLOCK_SIZE, backend="sdpa")
    executor.initialize_cache(8, 0)
    plans = []
    opened = torch_executor.step_plan

    @contextlib.contextmanager
    def recording(tensors):
        with opened(tensors) as plan:
            plans.append(plan)
            yield plan

    monkeypatch.setattr(torch_executor, "step_plan", recording)
    executor.execute(pack_decoder_step([3], [1], [[2]], [[5, 6, 7, 8]], [1], BLOCK_SIZE))
    (plan,) = plans
    # slot checks, attention checks and the sdpa plan: one entry each for all layers
    assert len(plan) == 3


def _stale_executor(kind: str, model, onnx_path):
    """A fresh executor: a torch backend's name, or ``ort-bodies`` / ``ort-native``."""
    if kind.startswith("ort-"):
        from attnexport.runtime import OrtExecutor

        return OrtExecutor(onnx_path, num_threads=1, kernels=kind.removeprefix("ort-"))
    backend = _available_backend(kind)
    device = "cpu" if "cpu" in backend.capabilities.devices else "cuda"
    choice = kind if device == "cpu" else "auto"  # as in test_other_backends_match_sdpa
    return TorchExecutor(model, block_size=BLOCK_SIZE, backend=choice, device=device)


@pytest.mark.parametrize("fill", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize(
    "kind",
    [
        "sdpa",
        "ipex",
        "xformers",
        "ort-bodies",
        pytest.param("ort-native", marks=ORT_KERNEL_MODES[1].marks),
    ],
)
def test_stale_cache_values_do_not_leak_into_requests(kind, fill, model, onnx_path, eager_tokens):
    """A pool whose every slot holds NaN/Inf (what freed blocks of an earlier request may hold)
    generates the same tokens as a zeroed one: unwritten slots never enter the arithmetic."""
    engine = Engine(_stale_executor(kind, model, onnx_path), CACHE, LIMITS)
    for cache in engine.executor.kv_caches:  # the OrtExecutor binds these very arrays
        torch.as_tensor(cache).fill_(fill)
    assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == eager_tokens
