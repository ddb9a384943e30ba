"""The quantization options beyond round to nearest, on tiny zoo models: a tied embedding
stored once whatever the logits projection's format, HQQ's float zero points moved onto the
packed kernels without changing the product, and MatMulNBits rows padded so that a sequence's
logits do not depend on its batch."""

from __future__ import annotations

import collections
import shutil
import subprocess
import sys

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper

from attnexport import ort_kernels
from attnexport.batch_invariance import (
    _kernel_key,
    _padded_groups,
    drop_unneeded_rows,
    rows_agree,
)
from attnexport.lowering import PagedOrtSession, WeightQuantization, quantize_weights
from attnexport.lowering.float_zero_points import split_float_zero_points
from attnexport.lowering.quantize import PREFILL_ROWS, _quantize_layers
from attnexport.runtime.step_driver import PagedDriver
from tests.helpers import requires_ort_kernels

PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [200, 1, 33, 7], list(range(10, 40))]


@pytest.fixture(scope="module")
def gpt2(zoo_float_onnx):
    """Tiny GPT-2 (tied embedding): (model, input names, float ONNX path)."""
    return zoo_float_onnx("gpt2")


@pytest.fixture(scope="module")
def llama(zoo_float_onnx):
    return zoo_float_onnx("llama")


def _quantized(exported, tmp_path, quantization: WeightQuantization):
    path = tmp_path / "model.onnx"
    shutil.copy(exported[2], path)
    quantize_weights(path, quantization)
    return path


def _logits(exported, path, prompts, steps: int = 0) -> list[torch.Tensor]:
    """Per prompt: its prefill logits then those of ``steps`` teacher-forced decode steps,
    all prompts in one batch (native kernels)."""
    model, names, _ = exported
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    ort_kernels.register(options)
    session = PagedOrtSession(path, session_options=options)

    def run(inputs, kv_caches):
        feeds = dict(zip(names, (*inputs, kv_caches), strict=True))
        return next(iter(session.run(feeds).values())), kv_caches

    driver = PagedDriver(run, model.cache_spec(16), num_blocks=32)
    for prompt in prompts:
        driver.add(prompt)
    out = driver.prefill(all_logits=True)
    rows = [[out[i]] for i in range(len(prompts))]
    for step in range(steps):
        for seq in range(len(prompts)):
            driver.append(seq, 7 * step + 3)
        out = driver.step(dict.fromkeys(range(len(prompts)), 1))
        for seq in range(len(prompts)):
            rows[seq].append(out[seq])
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("head", ["float", "int8", "int4"])
def test_a_tied_embedding_is_stored_once(gpt2, tmp_path, head):
    float_model = onnx.load(str(gpt2[2]))
    initializers = {i.name for i in float_model.graph.initializer}
    (table,) = {n.input[0] for n in float_model.graph.node if n.op_type == "Gather"} & {
        n.input[1] for n in float_model.graph.node if n.op_type == "Gemm"
    }  # the logits projection reads the embedding's table, no transposed copy
    assert f"{table}.T" not in initializers

    path = _quantized(gpt2, tmp_path, WeightQuantization("int8", lm_head=head))
    model = onnx.load(str(path))
    nodes = collections.defaultdict(list)
    for node in model.graph.node:
        nodes[node.op_type].append(node)
    if head == "float":
        assert [n.input[1] for n in nodes["Gemm"]] == [table]
        assert table in {n.input[0] for n in nodes["Gather"]}
    else:
        (gather,) = nodes["GatherBlockQuantized"]
        # int16 activations (int8's default): attnexport.MatMul8Bits / MatMul4Bits on
        # MatMulNBits' storage
        assert gather.input[0] in {n.input[1] for n in nodes[f"MatMul{head[3]}Bits"]}
        assert table not in {i.name for i in model.graph.initializer}
        assert not nodes["Gemm"]

    quantized = torch.cat(_logits(gpt2, path, PROMPTS))
    reference = torch.cat(_logits(gpt2, gpt2[2], PROMPTS))
    # Measured (tiny gpt2, seed 0; int8 layers): lm_head float 0.0053, int8 0.0091, int4 0.058
    # max abs on logits of ~0.66.
    bound = {"float": 0.02, "int8": 0.03, "int4": 0.2}[head]
    assert float((quantized - reference).abs().max()) <= bound


def test_the_logits_projection_has_a_block_size_of_its_own(gpt2, tmp_path):
    """``lm_head_block_size``: the tied table (its MatMul4Bits and the embedding's
    GatherBlockQuantized) in blocks of its own, the layers in ``block_size``."""
    quantization = WeightQuantization("int4", block_size=16, lm_head="int4", lm_head_block_size=32)
    path = _quantized(gpt2, tmp_path, quantization)
    model = onnx.load(str(path))
    blocks = {
        n.input[1]: {a.name: a.i for a in n.attribute}["block_size"]
        for n in model.graph.node
        if n.op_type in ("MatMulNBits", "MatMul4Bits", "MatMul8Bits")
    }
    (gather,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    head = gather.input[0]
    assert blocks.pop(head) == 32
    assert {a.name: a.i for a in gather.attribute}["block_size"] == 32
    assert set(blocks.values()) == {16}
    quantized = torch.cat(_logits(gpt2, path, PROMPTS))
    reference = torch.cat(_logits(gpt2, gpt2[2], PROMPTS))
    assert float((quantized - reference).abs().max()) <= 0.2  # lm_head int4's bound above


@pytest.mark.parametrize("offsets", ["float32", "int8"])
def test_hqq_zero_points_move_onto_the_packed_kernels(llama, tmp_path, offsets):
    """float32 offsets: the same product as the float zero points; int8 offsets (the default):
    within a small fraction of the int4 weights' own error."""
    quantization = WeightQuantization(
        "int4", algorithm="hqq", symmetric=False, accuracy_level=1, lm_head="float"
    )
    nodes = [n.name for n in onnx.load(str(llama[2])).graph.node if n.op_type == "MatMul"]
    float_zero_points = _quantize_layers(onnx.load(str(llama[2])), nodes[-1:], quantization)
    zero_points = [n for n in float_zero_points.graph.node if n.op_type == "MatMulNBits"]
    assert all(len(n.input) == 4 for n in zero_points)  # HQQ's float zero points
    onnx.save(float_zero_points, str(tmp_path / "float.onnx"))
    assert split_float_zero_points(float_zero_points, offsets) == len(zero_points)
    nbits = [n for n in float_zero_points.graph.node if n.op_type == "MatMulNBits"]
    assert all(len(n.input) == 3 for n in nbits)
    assert len(nbits) == len(zero_points)
    fused = [n for n in float_zero_points.graph.node if n.op_type == "AddBlockOffsets"]
    assert len(fused) == (len(zero_points) if offsets == "int8" else 0)
    onnx.save(float_zero_points, str(tmp_path / "split.onnx"))
    before = torch.cat(_logits(llama, tmp_path / "float.onnx", PROMPTS))
    after = torch.cat(_logits(llama, tmp_path / "split.onnx", PROMPTS))
    reference = torch.cat(_logits(llama, llama[2], PROMPTS))
    error = float((after - before).abs().max())
    if offsets == "float32":
        # The same product up to float32 rounding (measured 2.4e-7 on logits of ~0.7).
        assert error <= 5e-6
    else:
        # Measured 1.0e-3, 0.011x the int4 weights' own error (0.09) on this model.
        assert error <= 0.05 * float((before - reference).abs().max()), error


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_a_sequence_decodes_the_same_alone_and_batched(llama, tmp_path, fmt):
    """The mechanism behind greedy answers that changed when batched: MatMulNBits runs one
    row through its own kernel. With the padding row (the default), a sequence's decode logits
    alone equal, bit for bit, its logits next to others (prefilling or decoding)."""
    path = _quantized(llama, tmp_path, WeightQuantization(fmt))
    prompt = PROMPTS[0]
    (alone,) = _logits(llama, path, [prompt], steps=3)
    batched = _logits(llama, path, [PROMPTS[1], prompt, PROMPTS[2]], steps=3)[1]
    assert torch.equal(alone, batched)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_int8_prefill_activations_change_only_calls_of_many_rows(llama, tmp_path, fmt):
    """``prefill_activations="int8"`` writes ``int8_from_rows`` (128) on every MatMul8Bits /
    MatMul4Bits: a prefill of fewer rows and the decode steps after it are the int16 export's
    logits bit for bit; a prefill of 128 rows or more is within a few percent of them."""
    (tmp_path / "int16").mkdir()
    (tmp_path / "int8").mkdir()
    fine = _quantized(llama, tmp_path / "int16", WeightQuantization(fmt))
    coarse = _quantized(
        llama, tmp_path / "int8", WeightQuantization(fmt, prefill_activations="int8")
    )
    nodes = [n for n in onnx.load(str(coarse), load_external_data=False).graph.node]
    rows = {
        helper.get_node_attr_value(n, "int8_from_rows")
        for n in nodes
        if n.op_type.startswith("MatMul") and n.domain == "attnexport"
    }
    assert rows == {PREFILL_ROWS}
    for a, b in zip(
        _logits(llama, fine, PROMPTS, 2), _logits(llama, coarse, PROMPTS, 2), strict=True
    ):
        assert torch.equal(a, b)
    long = [list(range(3, 3 + PREFILL_ROWS))]
    a, b = _logits(llama, fine, long)[0], _logits(llama, coarse, long)[0]
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05 * a.abs().max().item())


@requires_ort_kernels
def test_int8_decode_activations_round_every_call_alike(llama, tmp_path):
    """``decode_activations="int8"`` writes ``int8_from_rows`` 1: every call in int8 steps, so a
    sequence's logits alone equal its logits batched (a prefill of 30 rows beside it), and its
    decode steps differ from the int8-prefill export's (whose short calls stay int16)."""
    (tmp_path / "prefill").mkdir()
    (tmp_path / "every").mkdir()
    prefill = _quantized(
        llama, tmp_path / "prefill", WeightQuantization("int4", prefill_activations="int8")
    )
    quantization = WeightQuantization("int4", prefill_activations="int8", decode_activations="int8")
    every = _quantized(llama, tmp_path / "every", quantization)
    assert quantization.manifest_entry([], 9)["decode_activations"] == "int8"
    nodes = onnx.load(str(every), load_external_data=False).graph.node
    rows = {
        helper.get_node_attr_value(n, "int8_from_rows")
        for n in nodes
        if n.op_type.startswith("MatMul") and n.domain == "attnexport"
    }
    assert rows == {1}
    prompt = PROMPTS[0]
    (alone,) = _logits(llama, every, [prompt], steps=3)
    assert torch.equal(alone, _logits(llama, every, [PROMPTS[1], prompt, PROMPTS[2]], steps=3)[1])
    (coarser,) = _logits(llama, prefill, [prompt], steps=3)
    assert not torch.equal(alone, coarser)
    torch.testing.assert_close(alone, coarser, rtol=0.05, atol=0.05 * coarser.abs().max().item())


def test_the_one_row_float_kernel_is_told_apart():
    """The probe behind dropped rows sees a kernel that runs one row its own way: MLAS's
    4-bit MatMulNBits with float activations has a one-row kernel and dequantizes into SGEMM
    for more rows."""
    assert not rows_agree(4, 32, 1, 256, 64, None)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_the_runtime_drops_the_rows_this_cpu_does_not_need(llama, tmp_path, fmt):
    """Every padded group whose kernels all pass the probe loses its row (Concat and Slice
    become Identity), the others keep it; int8 at accuracy level 4 (``--weights int8
    --weights-activations int8``, and the int4 default's head and offsets) is one kernel for
    every row on x86 MLAS (the int8 default, MatMul8Bits, has no padding)."""
    quantization = WeightQuantization(fmt, activations="int8")
    model = onnx.load(str(_quantized(llama, tmp_path, quantization)))
    initializers = {i.name: i for i in model.graph.initializer}
    groups = [
        all(rows_agree(*_kernel_key(node, initializers)) for node in matmuls)
        for _, _, matmuls in _padded_groups(model.graph)
    ]
    assert len(groups) == 9  # 2 layers x (qkv, o, gate_up, down), lm_head
    if not any(groups):
        pytest.skip("no MatMulNBits kernel of this CPU computes every row alike")
    assert drop_unneeded_rows(model) == sum(groups)
    assert len(list(_padded_groups(model.graph))) == len(groups) - sum(groups)
    assert sum(n.op_type == "Identity" for n in model.graph.node) == 2 * sum(groups)


def test_the_padding_keeps_every_row_off_the_one_row_kernel():
    """MLAS cuts a MatMulNBits' rows into tiles of 128 and runs a tile of one row through its
    one-row kernel (a batch of 129 rows computes its last row as if alone): with the zero row,
    the only row ever alone in a tile is the zero row (128 rows), and each row of a batch of
    any size equals its row in a batch of 300."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from attnexport.batch_invariance import pad_matmulnbits_rows
    from attnexport.lowering.lm_head import block_quantize
    from attnexport.matmul_nbits import matmulnbits_node

    rng = np.random.default_rng(0)
    packed, scales = block_quantize(rng.standard_normal((48, 64)).astype(np.float32), 4, 32)
    node = matmulnbits_node(
        ["x", "b", "s"], "y", k=64, n=48, bits=4, block_size=32, accuracy_level=4
    )
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", 48])],
        [numpy_helper.from_array(packed, "b"), numpy_helper.from_array(scales, "s")],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    )
    assert pad_matmulnbits_rows(model) == 1
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    x = rng.standard_normal((300, 64)).astype(np.float32)
    every = session.run(None, {"x": x})[0]
    for rows in (1, 2, 3, 127, 128, 129, 255, 256):
        assert np.array_equal(session.run(None, {"x": x[:rows]})[0], every[:rows]), rows


@requires_ort_kernels
def test_an_int4_export_loads_with_its_padding_rows_and_the_native_kernels(llama, tmp_path):
    """The file as it is (the rows the runtime does not drop): the padding rows' Concat and Slice
    around the MatMulNBits beside attnexport.AddBlockOffsets. When the kernel's shape inference
    passed an unnamed dim on as it was, onnxruntime 1.32 refused this file (a Concat after the
    node: "Negative dimension value"; test_add_block_offsets has the Slice that aborted the
    process). In a child process, so that an abort fails this test rather than the run."""
    path = _quantized(llama, tmp_path, WeightQuantization("int4", activations="int8"))
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["AddBlockOffsets"] > 0 and ops["Slice"] > 0
    script = (
        "import sys, onnxruntime as ort\n"
        "from attnexport import ort_kernels\n"
        "options = ort.SessionOptions()\n"
        "ort_kernels.register(options)\n"
        "ort.InferenceSession(sys.argv[1], options, providers=['CPUExecutionProvider'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
