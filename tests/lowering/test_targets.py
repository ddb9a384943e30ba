"""The three targets: attnexport nodes with bodies, standard ops only, and onnxruntime's
com.microsoft.PagedAttention for the CUDA execution provider (structure here; parity where a
CUDA GPU and onnxruntime's CUDA EP exist)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from attnexport.lowering import PagedOrtSession, export_program, read_contract, to_onnx
from attnexport.lowering.registry import DOMAIN
from tests.lowering.modules import (
    PagedAttentionOnly,
    StepPlanner,
    attention_inputs,
    write_and_attend,
)

BLOCK_SIZE = 4
ORT_CUDA_BLOCK_SIZE = 16
"""com.microsoft.PagedAttention's CUDA kernel needs a power of two >= 16."""
WINDOW, SOFT_CAP, SCALE = 7, 4.0, 0.3


def _inputs(dtype, num_blocks=8, plan=None, padding=1, seed=0, block_size=BLOCK_SIZE) -> dict:
    step = StepPlanner(num_blocks, block_size, seed=seed).step(plan or {0: 3, 1: 6}, padding)
    return attention_inputs(step, padding, head_size=16, dtype=dtype, seed=seed)


def _program(
    dtype,
    shared_tokens: bool = False,
    model: torch.nn.Module | None = None,
    block_size: int = BLOCK_SIZE,
):
    """The ops module (or ``model``, with its inputs) exported; ``shared_tokens``: one token
    dimension for queries and keys (no padding rows), as in a model whose q, k and v come from
    the same hidden states."""
    model = model or PagedAttentionOnly(SCALE, sliding_window=WINDOW, soft_cap=SOFT_CAP)
    caches = [torch.zeros(8, block_size, 2, 16, dtype=dtype) for _ in range(2)]
    # sample sequences of 1 and 2 blocks (a dynamic dimension must be >= 2 in the sample)
    plan = {0: 3, 1: block_size + 2}
    inputs = _inputs(dtype, plan=plan, padding=0 if shared_tokens else 1, block_size=block_size)
    shapes = None
    if shared_tokens:
        dim = torch.export.Dim
        tokens, seqs, blocks = dim("num_tokens"), dim("num_seqs"), dim("num_blocks")
        shapes = (
            *({0: tokens} for _ in range(4)),
            {0: seqs, 1: dim("max_blocks_per_seq")},
            {0: seqs},
            {0: seqs + 1},
            {0: blocks},
            {0: blocks},
        )
    return export_program(model, (*inputs.values(), *caches), dynamic_shapes=shapes)


def _domains(model: onnx.ModelProto) -> set[str]:
    return {node.domain for node in model.graph.node}


@pytest.fixture(scope="module")
def fp32_program():
    return _program(torch.float32)


def test_attnexport_target_attaches_only_the_bodies_it_uses(fp32_program, tmp_path):
    model = to_onnx(fp32_program, (), tmp_path / "m.onnx")
    kinds = sorted(n.op_type for n in model.graph.node if n.domain == DOMAIN)
    assert kinds == ["PagedAttention", "ReshapeAndCache"]
    assert sorted(f.name for f in model.functions) == ["PagedAttention", "ReshapeAndCache"]
    assert {o.domain: o.version for o in model.opset_import}[DOMAIN] == 1
    attention = next(n for n in model.graph.node if n.op_type == "PagedAttention")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in attention.attribute}
    assert attributes == {
        "scale": pytest.approx(SCALE),
        "causal": 1,
        "sliding_window": WINDOW,
        "logits_soft_cap": pytest.approx(SOFT_CAP),
        # The static geometry, from the shapes (query [T, 4, 16], caches [N, 4, 2, 16]).
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_size": 16,
        "block_size": BLOCK_SIZE,
        "prefill_bf16": 0,  # the schema's default (export --prefill-attention bfloat16: 1)
    }


def test_standard_target_has_only_standard_ops(fp32_program, tmp_path):
    model = to_onnx(fp32_program, (), tmp_path / "m.onnx", target="standard")
    assert _domains(model) <= {"", "ai.onnx"}
    assert not model.functions
    assert DOMAIN not in {o.domain for o in model.opset_import}
    producers = {out: node for node in model.graph.node for out in node.output}
    for cache in ("key_cache", "value_cache"):
        writer = producers[f"{cache}_out"]
        assert (writer.op_type, writer.input[0]) == ("ScatterND", cache)
    # ...and it still computes the same thing.
    session = PagedOrtSession(tmp_path / "m.onnx")
    inputs = _inputs(torch.float32, 16, {0: 2, 1: 1, 2: 5}, seed=3)
    caches = [torch.randn(16, BLOCK_SIZE, 2, 16) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    model_ = PagedAttentionOnly(SCALE, sliding_window=WINDOW, soft_cap=SOFT_CAP)
    expected = model_(*inputs.values(), *expected_caches)
    got = session.run({**inputs, "key_cache": caches[0], "value_cache": caches[1]})["output"]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(caches, expected_caches, atol=0, rtol=0)


@pytest.fixture(scope="module")
def ort_cuda_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ort_cuda") / "m.onnx"
    program = _program(torch.float16, shared_tokens=True, block_size=ORT_CUDA_BLOCK_SIZE)
    return to_onnx(program, (), path, target="ort-cuda"), path


def test_ort_cuda_maps_write_and_attention_to_one_contrib_node(ort_cuda_model):
    model, _ = ort_cuda_model
    assert DOMAIN not in _domains(model) and not model.functions
    (node,) = [n for n in model.graph.node if n.domain == "com.microsoft"]
    assert node.op_type == "PagedAttention"
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes == {
        "num_heads": 4,
        "kv_num_heads": 2,
        "scale": pytest.approx(SCALE),
        "softcap": pytest.approx(SOFT_CAP),
        "is_causal": 1,
        # the contrib op's window counts keys as ours does: p - k < w (measured on the CUDA
        # kernel; GroupQueryAttention's local_window_size is p - k <= w)
        "local_window_size": WINDOW,
    }
    producers = {out: n for n in model.graph.node for out in n.output}
    inputs = list(node.input)
    assert inputs[3:6] == ["key_cache", "value_cache", "query_start_loc"]
    assert inputs[7] == "block_tables" and inputs[8:10] == ["", ""]
    assert [producers[name].op_type for name in (inputs[0], inputs[1], inputs[2])] == [
        "Reshape"
    ] * 3
    assert producers[inputs[6]].op_type == "Sub"  # past_seqlens = seq_lens - query lengths
    clamp = producers[inputs[10]]  # slot_mapping: int32, every negative slot -> -1
    assert clamp.op_type == "Max" and producers[clamp.input[0]].op_type == "Cast"
    assert list(node.output[1:]) == ["key_cache_out", "value_cache_out"]
    output_reshape = producers["output"]
    assert output_reshape.op_type == "Reshape" and output_reshape.input[0] == node.output[0]
    assert read_contract(model).target == "ort-cuda"


def test_ort_cuda_slot_mapping_past_int32_fails_instead_of_wrapping(ort_cuda_model, tmp_path):
    """The contrib op takes int32 slots: the int64 slot_mapping is cast to int32 in the graph,
    where 2^32 + 5 would become slot 5. The subgraph that computes the contrib op's slots runs
    here on the CPU provider (no CUDA EP here): valid and negative slots come out as before,
    a slot past int32 fails the run in the node that names it."""
    import onnxruntime as ort

    model, path = ort_cuda_model
    (node,) = [n for n in model.graph.node if n.domain == "com.microsoft"]
    part = tmp_path / "slots.onnx"
    onnx.utils.extract_model(str(path), str(part), ["slot_mapping"], [node.input[10]])
    session = ort.InferenceSession(str(part), providers=["CPUExecutionProvider"])
    slots = np.array([3, -1, -7, 2**31 - 1, -(2**40)], dtype=np.int64)
    (out,) = session.run(None, {"slot_mapping": slots})
    assert out.dtype == np.int32 and out.tolist() == [3, -1, -1, 2**31 - 1, -1]
    for bad in (2**32 + 5, 2**31):
        with pytest.raises(Exception, match="invalid_slot_mapping"):
            session.run(None, {"slot_mapping": np.array([1, bad], dtype=np.int64)})


@pytest.mark.parametrize(
    ("dtype", "block_size", "reason"),
    [
        # the contrib op is fp16/bf16 only
        (torch.float32, ORT_CUDA_BLOCK_SIZE, "dtype"),
        # its CUDA kernel refuses such a run ("block_size must be a power of two and at least
        # 16", onnxruntime 1.31.1 on an H200): mapped, the model failed at its first step
        (torch.float16, 4, "block_size=4 (com.microsoft.PagedAttention needs a power of two"),
        (torch.float16, 24, "block_size=24"),
    ],
)
def test_ort_cuda_keeps_what_the_contrib_op_cannot_compute(dtype, block_size, reason, tmp_path):
    """The nodes keep their bodies, with a note saying why."""
    program = _program(dtype, shared_tokens=True, block_size=block_size)
    model = to_onnx(program, (), tmp_path / "m.onnx", target="ort-cuda")
    assert "com.microsoft" not in _domains(model)
    assert sorted(f.name for f in model.functions) == ["PagedAttention", "ReshapeAndCache"]
    notes = read_contract(model).extra["target_notes"]
    assert f"kept with its body: {reason}" in notes


class _TwoReadersOfOneWrite(torch.nn.Module):
    """One cache write read by two attentions: the contrib op writes and attends in one node,
    so only one of them can become it."""

    def forward(self, query, key, value, slot_mapping, block_tables, seq_lens, offsets, kc, vc):
        metadata = (block_tables, seq_lens, offsets)
        first = write_and_attend(query, key, value, (kc, vc), slot_mapping, metadata, SCALE)
        second = torch.ops.attnexport.paged_attention(query, kc, vc, *metadata, 0.5)
        return first + second


def test_ort_cuda_maps_one_attention_per_write(tmp_path):
    program = _program(
        torch.float16,
        shared_tokens=True,
        model=_TwoReadersOfOneWrite(),
        block_size=ORT_CUDA_BLOCK_SIZE,
    )
    model = to_onnx(program, (), tmp_path / "m.onnx", target="ort-cuda")
    (contrib,) = [n for n in model.graph.node if n.domain == "com.microsoft"]
    (kept,) = [n for n in model.graph.node if n.domain == DOMAIN]
    assert kept.op_type == "PagedAttention"
    # The kept attention reads the caches the contrib node wrote (its outputs 1 and 2).
    assert list(kept.input[1:3]) == list(contrib.output[1:3])
    assert list(contrib.output[1:]) == ["kc_out", "vc_out"]
    notes = read_contract(model).extra["target_notes"]
    assert "kept with its body: its cache write feeds another attention already mapped" in notes


def _cuda_ep_available() -> str | None:
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider here (CPU-only build)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


def test_ort_cuda_parity_on_gpu(ort_cuda_model):
    reason = _cuda_ep_available()
    if reason:
        pytest.skip(f"ort-cuda parity needs the CUDA EP: {reason}")
    _, path = ort_cuda_model
    session = PagedOrtSession(path, providers=["CUDAExecutionProvider"])
    model = PagedAttentionOnly(SCALE, sliding_window=WINDOW, soft_cap=SOFT_CAP)
    step = _inputs(
        torch.float16, 32, {0: 9, 1: 1}, padding=0, seed=2, block_size=ORT_CUDA_BLOCK_SIZE
    )
    inputs = {k: v.cuda() for k, v in step.items()}
    shape = (32, ORT_CUDA_BLOCK_SIZE, 2, 16)
    caches = [torch.randn(shape, dtype=torch.float16).cuda() for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    expected = model(*inputs.values(), *expected_caches)
    got = session.run({**inputs, "key_cache": caches[0], "value_cache": caches[1]})["output"]
    torch.testing.assert_close(got.cuda(), expected, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(caches, expected_caches, atol=0, rtol=0)


SWEEP_WINDOW = 40


@pytest.fixture(scope="module")
def ort_cuda_sweep_models(tmp_path_factory):
    """ort-cuda files of the ops module with and without a sliding window (block size 16)."""
    paths = {}
    for window in (-1, SWEEP_WINDOW):
        module = PagedAttentionOnly(SCALE, sliding_window=window)
        program = _program(
            torch.float16, shared_tokens=True, model=module, block_size=ORT_CUDA_BLOCK_SIZE
        )
        paths[window] = tmp_path_factory.mktemp("ort_cuda_sweep") / "m.onnx"
        to_onnx(program, (), paths[window], target="ort-cuda")
    return paths


@pytest.mark.parametrize("window", [-1, SWEEP_WINDOW], ids=["full", "window"])
def test_ort_cuda_lengths_sweep_on_gpu(ort_cuda_sweep_models, window):
    """The contrib op over every context length 1..130 (a prefill of all but the last token in
    chunks of up to 48, then one decode step per sequence) against the sdpa backend on the same
    GPU; the failure names the steps and lengths that differ."""
    reason = _cuda_ep_available()
    if reason:
        pytest.skip(f"ort-cuda parity needs the CUDA EP: {reason}")
    from attnexport.custom_ops import use_backend

    session = PagedOrtSession(ort_cuda_sweep_models[window], providers=["CUDAExecutionProvider"])
    model = PagedAttentionOnly(SCALE, sliding_window=window)
    lengths = list(range(1, 131))
    planner = StepPlanner(1200, ORT_CUDA_BLOCK_SIZE, seed=5)
    shape = (1200, ORT_CUDA_BLOCK_SIZE, 2, 16)
    caches = [torch.zeros(shape, dtype=torch.float16).cuda() for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    done = dict.fromkeys(range(len(lengths)), 0)
    plans = []
    while any(done[i] < n - 1 for i, n in enumerate(lengths)):
        plan = {i: min(48, n - 1 - done[i]) for i, n in enumerate(lengths) if done[i] < n - 1}
        for i, count in plan.items():
            done[i] += count
        plans.append(plan)
    plans.append(dict.fromkeys(range(len(lengths)), 1))
    wrong = []
    for number, plan in enumerate(plans):
        step = planner.step(plan)
        inputs = attention_inputs(step, head_size=16, dtype=torch.float16, seed=number)
        inputs = {k: v.cuda() for k, v in inputs.items()}
        with use_backend("sdpa"), torch.no_grad():
            expected = model(*inputs.values(), *expected_caches)
        got = session.run({**inputs, "key_cache": caches[0], "value_cache": caches[1]})["output"]
        error = (got.cuda().float() - expected.float()).abs().amax(dim=(1, 2))
        starts = inputs["query_start_loc"].tolist()
        for row, seq in enumerate(plan):
            worst = float(error[starts[row] : starts[row + 1]].max())
            if worst > 1e-2:
                kind = "decode" if number == len(plans) - 1 else f"chunk {number}"
                wrong.append(f"{kind} of length {lengths[seq]}: {worst:.3f}")
    assert not wrong, f"{len(wrong)} sequences differ: " + "; ".join(wrong[:40])


def test_metadata_records_the_caches(ort_cuda_model):
    model, _ = ort_cuda_model
    props = {p.key: p.value for p in model.metadata_props}
    assert json.loads(props["cache_outputs"]) == {
        "key_cache": "key_cache_out",
        "value_cache": "value_cache_out",
    }
    assert props["dtype"] == "float16"
