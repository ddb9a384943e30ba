"""Eager vs ExportedProgram vs the ONNX file on onnxruntime (IO binding, caches updated in
place), over several steps whose shapes differ from the export sample: prefill, decode steps and
a mixed batch (chunked prefill + decode + a new prompt), with GQA, ALiBi, windows, soft caps,
padded slots, int32 and int64 slot mappings, non-causal cross-attention over a cache written
once, and varlen (encoder) attention."""

from __future__ import annotations

import pytest
import torch

from attnexport.lowering import PagedOrtSession, export_program, to_onnx
from attnexport.tolerances import tolerance
from tests.lowering.modules import (
    AttentionStack,
    CrossAttention,
    LayerOptions,
    PagedAttentionOnly,
    StepPlanner,
    VarlenEncoder,
    attention_inputs,
)

FP32_MAX_ERROR = 1e-5
BLOCK_SIZE = 4
LAYERS = (
    LayerOptions(),  # plain causal GQA
    LayerOptions(alibi=True, logits_soft_cap=3.0),
    LayerOptions(sliding_window=5),
)
# (new tokens per sequence, padding slots) per step; the export sample is another batch.
STEPS = (
    ({0: 7, 1: 12, 2: 3}, 2),  # prefill
    ({0: 1, 1: 1, 2: 1}, 0),  # decode
    ({0: 1, 1: 1, 2: 1}, 3),
    ({0: 1, 1: 1, 2: 1}, 1),
    ({0: 1, 1: 1, 2: 5, 3: 4}, 1),  # mixed: decodes, a prefill chunk and a new prompt
)


def assert_fp32_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=FP32_MAX_ERROR, rtol=0)


def _caches(num_layers: int, num_blocks: int, model: AttentionStack, dtype=torch.float32):
    layer = model.layers[0]
    shape = (num_blocks, BLOCK_SIZE, layer.kv_heads, layer.head_size)
    generator = torch.Generator().manual_seed(7)
    # Random contents: stale data in unused slots must not leak into the results.
    return [torch.randn(shape, generator=generator).to(dtype) for _ in range(2 * num_layers)]


def _stack_inputs(step: dict, hidden: int, padding: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = int(step["query_start_loc"][-1])
    states = torch.randn(tokens + padding, hidden, generator=generator)
    return {"hidden": states[:tokens].clone(), "key_states": states, **step}


@pytest.fixture(scope="module")
def stack() -> AttentionStack:
    return AttentionStack(LAYERS)


@pytest.mark.parametrize(
    ("target", "slot_dtype"),
    [("attnexport", torch.int32), ("standard", torch.int64)],
    ids=["attnexport-slots32", "standard-slots64"],
)
def test_decoder_stack_steps_match_eager(stack, tmp_path, target, slot_dtype):
    sample_step = StepPlanner(8, BLOCK_SIZE, seed=3).step({0: 3, 1: 5}, 2, slot_dtype)
    sample = _stack_inputs(sample_step, 24, 2, seed=0)
    sample_caches = _caches(len(LAYERS), 8, stack)
    args = (*sample.values(), sample_caches)
    program = export_program(stack, args)
    model = to_onnx(program, args, tmp_path / "stack.onnx", target=target)
    assert [o.name for o in model.graph.output] == [
        "output",
        *(f"kv_caches_{i}_out" for i in range(2 * len(LAYERS))),
    ]
    session = PagedOrtSession(tmp_path / "stack.onnx")

    planner = StepPlanner(64, BLOCK_SIZE, seed=1)
    eager_caches = _caches(len(LAYERS), 64, stack)
    program_caches = [c.clone() for c in eager_caches]
    onnx_caches = [c.clone() for c in eager_caches]
    for index, (plan, padding) in enumerate(STEPS):
        step = planner.step(plan, padding, slot_dtype)
        inputs = _stack_inputs(step, 24, padding, seed=index + 10)
        with torch.no_grad():
            expected = stack(*inputs.values(), eager_caches)
            from_program = program.module()(*inputs.values(), program_caches)
        got = session.run({**inputs, "kv_caches": onnx_caches})["output"]
        assert_fp32_close(from_program, expected)
        assert_fp32_close(got, expected)
        for ours, theirs in zip(onnx_caches, eager_caches, strict=True):
            assert_fp32_close(ours, theirs)  # updated in place through the IO binding


def test_cross_attention_over_a_cache_written_once(tmp_path):
    """Named cache inputs; the cache is written at the first step only (0 tokens later)."""
    model = CrossAttention()
    dims = torch.export.Dim
    tokens, enc_tokens = dims("num_tokens"), dims("num_encoder_tokens", min=0)
    seqs, blocks, width = dims("num_seqs"), dims("num_blocks"), dims("max_blocks_per_seq")
    dynamic_shapes = {
        "hidden": {0: tokens},
        "encoder_states": {0: enc_tokens},
        "cross_slot_mapping": {0: enc_tokens},
        "block_tables": {0: seqs, 1: width},
        "seq_lens": {0: seqs},
        "query_start_loc": {0: seqs + 1},
        "key_cache": {0: blocks},
        "value_cache": {0: blocks},
    }

    def inputs(cache_step: dict, query_lens: list[int], write: bool, seed: int) -> dict:
        generator = torch.Generator().manual_seed(seed)
        count = len(cache_step["slot_mapping"]) if write else 0
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        return {
            "hidden": torch.randn(sum(query_lens), 24, generator=generator),
            "encoder_states": torch.randn(count, 24, generator=generator),
            "cross_slot_mapping": cache_step["slot_mapping"][:count],
            "block_tables": cache_step["block_tables"],
            "seq_lens": cache_step["seq_lens"],  # the encoder lengths
            "query_start_loc": starts.to(torch.int32),
        }

    sample = inputs(StepPlanner(8, BLOCK_SIZE, seed=2).step({0: 3, 1: 6}), [2, 3], True, 0)
    sample_caches = [torch.zeros(8, BLOCK_SIZE, 1, 8) for _ in range(2)]
    args = (*sample.values(), *sample_caches)
    onnx_model = to_onnx(model, args, tmp_path / "cross.onnx", dynamic_shapes=dynamic_shapes)
    assert [i.name for i in onnx_model.graph.input][-2:] == ["key_cache", "value_cache"]
    assert [o.name for o in onnx_model.graph.output] == [
        "output",
        "key_cache_out",
        "value_cache_out",
    ]
    session = PagedOrtSession(tmp_path / "cross.onnx")

    encoder_outputs = StepPlanner(32, BLOCK_SIZE, seed=4).step({0: 5, 1: 9, 2: 2})
    eager = [torch.randn(32, BLOCK_SIZE, 1, 8) for _ in range(2)]
    ours = [c.clone() for c in eager]
    for seed, (query_lens, write) in enumerate([([4, 1, 3], True), ([1, 1, 1], False)]):
        step = inputs(encoder_outputs, query_lens, write, seed + 1)
        with torch.no_grad():
            expected = model(*step.values(), *eager)
        got = session.run({**step, "key_cache": ours[0], "value_cache": ours[1]})["output"]
        assert_fp32_close(got, expected)
        assert_fp32_close(ours[0], eager[0])
        assert_fp32_close(ours[1], eager[1])


def test_varlen_encoder_matches_eager(tmp_path):
    model = VarlenEncoder()

    def batch(lengths, memory_lengths, seed):
        generator = torch.Generator().manual_seed(seed)

        def offsets(lens):
            return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

        return (
            torch.randn(sum(lengths), 24, generator=generator),
            offsets(lengths),
            torch.randn(sum(memory_lengths), 24, generator=generator),
            offsets(memory_lengths),
        )

    to_onnx(model, batch([3, 5], [4, 2], 0), tmp_path / "enc.onnx")
    session = PagedOrtSession(tmp_path / "enc.onnx")
    names = ("hidden", "cu_seqlens", "memory", "cu_seqlens_memory")
    for seed, (lengths, memory_lengths) in enumerate([([6, 1, 9], [2, 7, 3]), ([2, 2], [9, 1])]):
        args = batch(lengths, memory_lengths, seed + 1)
        with torch.no_grad():
            expected = model(*args)
        assert_fp32_close(session.run(dict(zip(names, args, strict=True)))["output"], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_attention_within_dtype_rounding(tmp_path, dtype):
    """No weights (onnxruntime's CPU MatMul has no bfloat16 kernel): the ops alone, int64 slots
    with padding; caches must match exactly (a write copies values)."""
    model = PagedAttentionOnly(sliding_window=7, soft_cap=4.0)
    generator = torch.Generator().manual_seed(0)

    def step_inputs(planner, plan, padding, seed):
        step = planner.step(plan, padding)
        return attention_inputs(step, padding, head_size=16, dtype=dtype, seed=seed)

    sample = step_inputs(StepPlanner(8, BLOCK_SIZE), {0: 3, 1: 6}, 2, seed=0)
    caches = [torch.zeros(8, BLOCK_SIZE, 2, 16, dtype=dtype) for _ in range(2)]
    to_onnx(model, (*sample.values(), *caches), tmp_path / "half.onnx")
    session = PagedOrtSession(tmp_path / "half.onnx")
    planner = StepPlanner(40, BLOCK_SIZE, seed=5)
    eager = [torch.randn(40, BLOCK_SIZE, 2, 16, generator=generator).to(dtype) for _ in range(2)]
    ours = [c.clone() for c in eager]
    for index, (plan, padding) in enumerate(STEPS):
        step = step_inputs(planner, plan, padding, seed=index + 1)
        with torch.no_grad():
            expected = model(*step.values(), *eager)
        got = session.run({**step, "key_cache": ours[0], "value_cache": ours[1]})["output"]
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), **tolerance(dtype))
        torch.testing.assert_close(ours, eager, atol=0, rtol=0)
