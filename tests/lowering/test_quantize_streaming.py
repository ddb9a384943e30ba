"""``quantize_weights`` on a model whose weights are in ``model.onnx.data`` reads them one at a
time (``attnexport.lowering.quantize._reading_each_weight``): the result is the very model the
quantizer makes from the weights held in memory, and the float model is never whole in memory
(benchmarks/export_cost.py measures the real checkpoint's ``--weights int4`` export)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from attnexport.lowering import WeightQuantization, quantize_weights
from tests.helpers import resident_growth


def _save_external(model: onnx.ModelProto, path: Path) -> None:
    """Every tensor of ``model`` in ``path``'s ``model.onnx.data``, as a large export is."""
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data",
        size_threshold=0,
    )


@pytest.mark.parametrize(
    "quantization",
    [
        WeightQuantization("int4"),  # hqq, asymmetric, lm_head int8
        WeightQuantization("int8"),  # rtn, symmetric
        WeightQuantization("int4", symmetric=True, lm_head="int4"),  # rtn
        WeightQuantization("int4", algorithm="k_quant", keep_float=("*.down_proj",)),
    ],
    ids=["int4-hqq", "int8-rtn", "int4-rtn-symmetric", "int4-k_quant-keep-float"],
)
def test_streamed_quantization_is_the_in_memory_one(zoo_float_onnx, tmp_path, quantization):
    float_onnx = zoo_float_onnx("llama")[2]
    in_memory, streamed = tmp_path / "memory" / "model.onnx", tmp_path / "streamed" / "model.onnx"
    in_memory.parent.mkdir()
    streamed.parent.mkdir()
    shutil.copy(float_onnx, in_memory)
    _save_external(onnx.load(str(float_onnx)), streamed)
    assert quantize_weights(streamed, quantization) == quantize_weights(in_memory, quantization)
    streamed_model, in_memory_model = onnx.load(str(streamed)), onnx.load(str(in_memory))
    # the initializers in order and byte for byte (a tensor read from external data records
    # its data_location, DEFAULT, where the inline one leaves it unset: the same on both sides
    # of a real export, whose float weights are all external)
    assert _tensors(streamed_model) == _tensors(in_memory_model)
    # and the rest: nodes, attributes, opsets, metadata
    for model in (streamed_model, in_memory_model):
        model.graph.ClearField("initializer")
    assert streamed_model.SerializeToString() == in_memory_model.SerializeToString()


def _tensors(model: onnx.ModelProto) -> list[tuple[str, int, list[int], bytes]]:
    return [
        (t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes())
        for t in model.graph.initializer
    ]


MEASURE = """
import sys
import onnx, onnxruntime, torch
from onnxruntime.quantization import matmul_nbits_quantizer
from attnexport import lowering

before = status("VmRSS")
# rtn (onnxruntime's C++ block quantizer: little working memory of its own); the row padding,
# which copies the quantized model through onnx's shape inference, is another stage's cost
quantization = lowering.WeightQuantization("int4", symmetric=True, batch_invariant=False)
lowering.quantize_weights(sys.argv[1], quantization)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


def _projections(path: Path, layers: int, width: int) -> int:
    """A chain of ``layers`` MatMuls on ``[width, width]`` random float32 weights, saved with
    external data at ``path``; returns the weights' bytes."""
    rng = np.random.default_rng(0)
    nodes, weights = [], []
    for layer in range(layers):
        name = f"model.layers.{layer}.mlp.proj.weight"
        weights.append(
            numpy_helper.from_array(rng.standard_normal((width, width), np.float32), name)
        )
        nodes.append(
            helper.make_node("MatMul", [f"h{layer}", name], [f"h{layer + 1}"], name=f"mm{layer}")
        )
    graph = helper.make_graph(
        nodes,
        "projections",
        [helper.make_tensor_value_info("h0", onnx.TensorProto.FLOAT, ["tokens", width])],
        [helper.make_tensor_value_info(f"h{layers}", onnx.TensorProto.FLOAT, ["tokens", width])],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    _save_external(model, path)
    return layers * width * width * 4


def test_quantization_holds_one_float_weight_at_a_time(tmp_path):
    """The quantization's resident-set growth stays under the float weights' size (measured:
    0.67x, the quantized weights, one float weight at a time and what saving and checking the
    result hold). Loading the whole float model first, as ``onnx.load`` does, grew it by 1.67x."""
    path = tmp_path / "model.onnx"
    size = _projections(path, layers=32, width=1024)
    growth = resident_growth(MEASURE, str(path))
    assert growth < size, (
        f"peak {growth / 2**20:.0f} MiB over imports, float weights {size / 2**20:.0f} MiB"
    )
