"""Exports with a KV cache dtype of their own (``--kv-cache-dtype``) end to end: the model's
cache inputs and scale caches, the graph contract and manifest, the cache pools, and the engine
on onnxruntime (bodies), ``.pt2`` and eager torch, against float32 caches."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from attnexport import ort_kernels
from attnexport.artifact import ExportOptions, export_artifact, read_manifest, rebuild_eager_model
from attnexport.artifact.errors import ArtifactError
from attnexport.cli.verify_cmd import _batch, _eager_leg, _run_paged, verify_artifact
from attnexport.model_contract import GraphContract, read_contract
from attnexport.model_interface import CacheSpec
from attnexport.models import load_zoo_model
from attnexport.runtime.engine import Engine
from attnexport.runtime.executors.cache_pool import NumpyCachePool
from attnexport.runtime.executors.ort_executor import OrtExecutor
from attnexport.runtime.executors.torch_cache_pool import TorchCachePool
from attnexport.runtime.executors.torch_executor import TorchExecutor
from attnexport.runtime.sampling import SamplingParams
from attnexport.tolerances import kv_cache_logit_tolerance, logit_quality

PROMPTS = [[1, 5, 9, 33, 7], [3, 4, 100, 200, 17, 8, 9, 12, 2, 44, 51, 6, 7, 8, 9, 10, 11, 12, 13]]
GREEDY = SamplingParams(max_tokens=12)
CACHE_DTYPES = ("float16", "bfloat16", "int8")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The tiny zoo Llama exported (ONNX + .pt2) with float32 caches and each cache dtype."""
    root = tmp_path_factory.mktemp("kv_cache_dtype")
    for name in ("auto", *CACHE_DTYPES):
        export_artifact(
            "llama", root / name, ExportOptions(formats=("onnx", "pt2"), kv_cache_dtype=name)
        )
    return root


def _tokens(engine: Engine) -> list[list[int]]:
    return [list(o.token_ids) for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def float32_tokens(exports):
    return _tokens(Engine.from_path(exports / "auto", executor="ort"))


def test_graph_has_cache_inputs_of_the_dtype_and_scale_caches(exports):
    import onnx

    model = onnx.load(str(exports / "int8" / "model.onnx"))
    contract = read_contract(model)
    assert (contract.dtype, contract.kv_cache_dtype, contract.cache_dtype) == (
        "float32",
        "int8",
        "int8",
    )
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert len(contract.cache_inputs) == 8  # 2 layers x (key, value, key scales, value scales)
    for i, name in enumerate(contract.cache_inputs):
        kind = inputs[name]
        scale = i % 4 >= 2
        assert kind.elem_type == (onnx.TensorProto.FLOAT if scale else onnx.TensorProto.INT8)
        assert len(kind.shape.dim) == (3 if scale else 4)
        assert contract.cache_outputs[name] == f"{name}_out"
    bodies = {f.name: (len(f.input), len(f.output)) for f in model.functions}
    assert bodies["ReshapeAndCache"] == (7, 4) and bodies["PagedAttention"] == (9, 1)
    half = read_contract(exports / "float16" / "model.onnx")
    assert half.kv_cache_dtype == "float16" and len(half.cache_inputs) == 4
    assert read_contract(exports / "auto" / "model.onnx").kv_cache_dtype is None


def test_manifest_records_the_cache_dtype_and_old_manifests_still_read(exports):
    manifest = read_manifest(exports / "int8")
    assert manifest["kv_cache_dtype"] == "int8" and manifest["cache"]["dtype"] == "int8"
    assert read_manifest(exports / "auto")["kv_cache_dtype"] == "float32"
    old = exports / "auto" / "manifest.json"
    data = json.loads(old.read_text())
    data.pop("kv_cache_dtype")
    old.write_text(json.dumps(data))
    assert read_manifest(exports / "auto")["dtype"] == "float32"  # absent: the model's


def test_contract_without_kv_cache_dtype_means_the_model_dtype():
    props = GraphContract("attnexport", block_size=16, num_layers=1, dtype="float16").to_props()
    assert "kv_cache_dtype" not in props
    assert GraphContract.from_props(props).cache_dtype == "float16"
    props = GraphContract(
        "attnexport", block_size=16, num_layers=1, dtype="float32", kv_cache_dtype="int8"
    ).to_props()
    assert GraphContract.from_props(props).cache_dtype == "int8"


@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("executor", ["ort", "torch"])
def test_engine_greedy_tokens_equal_float32_caches(exports, float32_tokens, cache_dtype, executor):
    engine = Engine.from_path(exports / cache_dtype, executor=executor)
    assert engine.executor.cache_spec.dtype_name == cache_dtype
    assert _tokens(engine) == float32_tokens


def test_engine_runs_int8_caches_on_every_executor_alike(exports):
    ort_engine = Engine.from_path(exports / "int8", executor="ort")
    native = ort_kernels.unavailable_reason() is None
    assert ort_engine.executor.kernels == ("native" if native else "bodies")
    caches = ort_engine.executor.kv_caches
    assert [c.dtype.name for c in caches[:4]] == ["int8", "int8", "float32", "float32"]
    assert caches[2].shape == caches[0].shape[:3]
    tokens = _tokens(ort_engine)
    assert _tokens(Engine.from_path(exports / "int8", executor="torch")) == tokens
    eager = TorchExecutor(load_zoo_model("llama"), backend="sdpa", kv_cache_dtype=torch.int8)
    assert _tokens(Engine(eager)) == tokens
    assert any(np.abs(c).sum() > 0 for c in ort_engine.executor.kv_caches[2:4])  # scales written


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_logits_against_float32_caches_are_within_the_measured_tolerance(exports, cache_dtype):
    manifest = read_manifest(exports / cache_dtype)
    model = rebuild_eager_model(manifest)
    batch = _batch(manifest, 0, exports / cache_dtype)
    reduced = _run_paged(_eager_leg(model, "sdpa"), manifest, batch, 0)
    exact = copy.deepcopy(manifest)
    exact["kv_cache_dtype"] = exact["cache"]["dtype"] = "float32"
    reference = _run_paged(_eager_leg(model, "sdpa"), exact, batch, 0)
    bounds = kv_cache_logit_tolerance(getattr(torch, cache_dtype))
    for output in (o for o in reference if o.endswith("logits")):
        quality = logit_quality(reduced[output], reference[output])
        print(cache_dtype, output, quality)  # top-1 agreement is reported, not bounded
        assert quality["max_abs"] <= bounds["max_abs"], (output, quality)
        assert quality["kl"] <= bounds["kl"], (output, quality)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
def test_verify_passes_and_says_which_legs_it_left_out(exports, cache_dtype):
    reference, comparisons = verify_artifact(exports / cache_dtype)
    assert reference == "eager[sdpa]"
    assert {c.leg for c in comparisons} >= {"pt2", "onnx"}
    native = ort_kernels.unavailable_reason() is None
    assert ("onnx[native]" in {c.leg for c in comparisons}) == native
    assert all(c.ok for c in comparisons), [c for c in comparisons if not c.ok]


def test_cache_pools_allocate_scale_caches_and_move_their_blocks():
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.int8, block_size=4)
    assert spec.scaled and spec.num_cache_tensors == 8 and spec.num_self_tensors == 8
    assert spec.bytes_per_block == 2 * 2 * (4 * 2 * 8 * 1) + 2 * 2 * (4 * 2 * 4)
    pool = TorchCachePool(spec, num_blocks=6, num_cpu_blocks=3, device="cpu")
    numpy_pool = NumpyCachePool(
        CacheSpec(2, 2, 8, np.dtype("int8"), block_size=4), num_blocks=6, num_cpu_blocks=3
    )
    for caches in (pool.kv_caches, numpy_pool.kv_caches):
        assert [str(c.dtype).removeprefix("torch.") for c in caches[:4]] == [
            "int8",
            "int8",
            "float32",
            "float32",
        ]
        assert tuple(caches[2].shape) == (6, 4, 2) and not caches[2].any()
    for p in (pool, numpy_pool):
        p.kv_caches[2][1] = 0.5
        p.kv_caches[0][1] = 3
        p.swap_out([(1, 2)])
        p.copy_blocks([(1, 4)])
        assert float(p.cpu_caches[2][2].max()) == 0.5 and int(p.cpu_caches[0][2].max()) == 3
        assert float(p.kv_caches[6][4].max()) == 0.0 and float(p.kv_caches[2][4].min()) == 0.5


def test_bfloat16_numpy_caches_bind_in_place(exports):
    executor = OrtExecutor(exports / "bfloat16" / "model.onnx", kernels="bodies")
    executor.initialize_cache(num_blocks=8, num_cpu_blocks=0)
    cache = executor.kv_caches[0]
    assert cache.dtype.name == "bfloat16"
    assert executor.cache_ortvalues[0].data_ptr() == cache.ctypes.data


def test_export_refuses_a_cache_dtype_it_cannot_make(tmp_path):
    with pytest.raises(ArtifactError, match="--kv-cache-dtype int8 with --target ort-cuda"):
        export_artifact(
            "llama", tmp_path / "x", ExportOptions(target="ort-cuda", kv_cache_dtype="int8")
        )
    with pytest.raises(ArtifactError, match="--kv-cache-dtype: expected one of auto"):
        export_artifact("llama", tmp_path / "y", ExportOptions(kv_cache_dtype="int4"))
