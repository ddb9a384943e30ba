"""benchmarks/quality.py's bytes per token: counted on the graph onnxruntime runs, without the
tables a decoded token only gathers rows of. A tied int8 table read by MatMulNBits and by the
embedding's GatherBlockQuantized counts once, and the copy of its scales that onnxruntime folds
for the gather (a Reshape of a constant) is not counted: it was, 3.5 MB on SmolLM2."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quality.py"
VOCAB, HIDDEN, BLOCK = 64, 32, 16


@pytest.fixture(scope="module")
def quality():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tied_int8_model(path: Path) -> dict[str, int]:
    """ids -> GatherBlockQuantized(table) -> MatMulNBits(table) -> logits, as
    attnexport.lowering.lm_head writes a tied int8 head; returns the bytes a token reads of its
    initializers (the table, the scales, the shape of the gathered rows)."""
    blocks = HIDDEN // BLOCK
    table = np.random.default_rng(0).integers(0, 255, (VOCAB, blocks, BLOCK), dtype=np.uint8)
    scales = np.full((VOCAB, blocks), 0.01, np.float32)
    initializers = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(scales, "scales"),
        numpy_helper.from_array(np.array([-1, blocks, 1], np.int64), "scales_shape"),
        numpy_helper.from_array(np.array([-1, HIDDEN], np.int64), "rows"),
    ]
    table_format = dict(domain="com.microsoft", bits=8, block_size=BLOCK)  # both nodes read it
    nodes = [
        helper.make_node("Reshape", ["scales", "scales_shape"], ["scales3"]),
        helper.make_node(
            "GatherBlockQuantized",
            ["table", "ids", "scales3"],
            ["gathered"],
            gather_axis=0,
            quantize_axis=2,
            **table_format,
        ),
        helper.make_node("Reshape", ["gathered", "rows"], ["x"]),
        helper.make_node(
            "MatMulNBits", ["x", "table", "scales"], ["logits"], K=HIDDEN, N=VOCAB, **table_format
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "tied",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["T", VOCAB])],
        initializers,
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 10
    onnx.save(model, str(path))
    return {"table": table.nbytes, "scales": scales.nbytes, "rows": 16}


def test_a_tied_table_and_its_scales_count_once(quality, tmp_path):
    sizes = _tied_int8_model(tmp_path / "model.onnx")
    counted = quality.onnx_bytes_per_token(tmp_path / "model.onnx", native_kernels=False)
    assert counted == sizes["table"] + sizes["scales"] + sizes["rows"]
