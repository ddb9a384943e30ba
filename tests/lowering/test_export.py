"""export_program and the checks that keep caches exportable: the program keeps in-place
writes (and saves as .pt2), and every way of losing a cache fails with a clear message."""

from __future__ import annotations

import pytest
import torch

from attnexport.lowering import export_program, to_onnx
from tests.lowering.modules import PagedAttentionOnly, StepPlanner, attention_inputs

ops = torch.ops.attnexport
BLOCK_SIZE = 4


def _inputs(num_blocks: int = 8, plan=None, padding: int = 1) -> dict:
    step = StepPlanner(num_blocks, BLOCK_SIZE, seed=1).step(plan or {0: 3, 1: 6}, padding)
    return attention_inputs(step, padding)


def _caches(num_blocks: int = 8) -> list[torch.Tensor]:
    return [torch.zeros(num_blocks, BLOCK_SIZE, 2, 8) for _ in range(2)]


def test_program_keeps_in_place_writes_and_saves_as_pt2(tmp_path):
    model = PagedAttentionOnly()
    program = export_program(model, (*_inputs().values(), *_caches()))
    targets = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count(ops.reshape_and_cache.default) == 1
    assert targets.count(ops.paged_attention.default) == 1

    torch.export.save(program, tmp_path / "m.pt2")
    loaded = torch.export.load(tmp_path / "m.pt2")
    inputs = _inputs(20, {0: 9, 1: 1, 2: 4}, padding=2)  # new shapes
    expected_caches, caches = _caches(20), _caches(20)
    with torch.no_grad():
        expected = model(*inputs.values(), *expected_caches)
        got = loaded.module()(*inputs.values(), *caches)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(caches, expected_caches, atol=0, rtol=0)
    assert caches[0].abs().sum() > 0

    # A reloaded program lowers through its module (torch 2.8-2.13 cannot run_decompositions
    # on a deserialized program with a derived dim such as num_seqs + 1).
    proto = to_onnx(loaded.module(), (*inputs.values(), *caches), tmp_path / "m.onnx")
    assert [o.name for o in proto.graph.output] == ["output", "key_cache_out", "value_cache_out"]


class _BufferCache(torch.nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        cache = torch.zeros(8, BLOCK_SIZE, 2, 8)
        if kind == "buffer":
            self.register_buffer("key_cache", cache)
        elif kind == "parameter":
            self.key_cache = torch.nn.Parameter(cache, requires_grad=False)
        else:
            self.key_cache = cache  # a plain tensor attribute: a constant

    def forward(self, query, key, value, slot_mapping, block_tables, seq_lens, query_start_loc):
        ops.reshape_and_cache(key, value, self.key_cache, self.key_cache.clone(), slot_mapping)
        return query


@pytest.mark.parametrize("kind", ["buffer", "parameter", "constant"])
def test_cache_held_by_the_module_is_refused(kind):
    with pytest.raises(ValueError, match=r"key_cache is the module .*key_cache.*forward inputs"):
        export_program(_BufferCache(kind), tuple(_inputs().values()))


class _StackedCache(torch.nn.Module):
    def forward(self, query, key, value, slot_mapping, block_tables, seq_lens, query_start_loc, kv):
        ops.reshape_and_cache(key, value, kv[0], kv[1], slot_mapping)
        return ops.paged_attention(
            query, kv[0], kv[1], block_tables, seq_lens, query_start_loc, 0.5
        )


def test_cache_written_through_a_view_is_refused():
    kv = torch.zeros(2, 8, BLOCK_SIZE, 2, 8)
    with pytest.raises(ValueError, match="not a forward input itself"):
        export_program(_StackedCache(), (*_inputs().values(), kv))


class _ForeignWrite(PagedAttentionOnly):
    def forward(self, query, key, value, slot_mapping, *rest):
        key_cache = rest[-2]
        key_cache[0, 0].copy_(key[0])
        return super().forward(query, key, value, slot_mapping, *rest)


def test_in_place_write_by_another_op_is_refused():
    with pytest.raises(
        ValueError, match=r"forward input 'rest_3' is modified in place by aten\.copy_"
    ):
        export_program(_ForeignWrite(), (*_inputs().values(), *_caches()))


def test_automatic_shapes_refuse_a_sample_that_fixes_a_step_dimension():
    single = _inputs(plan={0: 3}, padding=0)  # one sequence: num_seqs would be fixed to 1
    with pytest.raises(ValueError, match=r"seq_lens dimension 0 \(num_seqs\) = 1.*>= 2"):
        export_program(PagedAttentionOnly(), (*single.values(), *_caches()))


def test_argument_errors(tmp_path):
    args = (*_inputs().values(), *_caches())
    with pytest.raises(TypeError, match=r"module: expected a torch\.nn\.Module"):
        export_program(lambda *a: a, args)
    with pytest.raises(ValueError, match="target: expected one of attnexport, standard, ort-cuda"):
        to_onnx(PagedAttentionOnly(), args, tmp_path / "m.onnx", target="tensorrt")
    program = export_program(PagedAttentionOnly(), args)
    with pytest.raises(ValueError, match="dynamic_shapes: only used when exporting a module"):
        to_onnx(program, args, tmp_path / "m.onnx", dynamic_shapes={})
    with pytest.raises(ValueError, match=r"output_names: expected 1 names"):
        to_onnx(program, args, tmp_path / "m.onnx", output_names=["a", "b"])
