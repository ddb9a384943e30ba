"""The packed model inputs of a step: host lists first, arrays and tensors made from them."""

from __future__ import annotations

import numpy as np
import torch

from attnexport.custom_ops import ScheduledSequence, build_attention_metadata
from attnexport.model_interface import DECODER_INPUT_NAMES
from attnexport.runtime.model_input import StepSequence, pack_step
from attnexport.runtime.torch_inputs import StepTensors


def _step(blocks: list[list[int]]) -> list[StepSequence]:
    return [
        StepSequence(ScheduledSequence(5, 1, blocks[0]), list(range(10, 16))),  # decode
        StepSequence(ScheduledSequence(0, 3, blocks[1]), [7, 8, 9], num_logits=2),  # prefill
        StepSequence(ScheduledSequence(4, 2, blocks[2]), list(range(20, 30)), num_logits=0),
    ]


def test_pack_step_gives_the_metadata_of_build_attention_metadata():
    sequences = _step([[7, 2], [4], [1, 3]])
    model_input = pack_step(sequences, block_size=4)
    expected = build_attention_metadata([s.scheduled for s in sequences], block_size=4)
    tensors = StepTensors(model_input)
    metadata = tensors.metadata
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        got, want = getattr(metadata, name), getattr(expected, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    for name in ("max_query_len", "max_seq_len", "num_prefills", "num_prefill_tokens"):
        assert getattr(metadata, name) == getattr(expected, name), name
    assert metadata.num_decode_tokens == expected.num_decode_tokens == 1
    assert tensors.input_ids.tolist() == [15, 7, 8, 9, 24, 25]
    assert tensors.positions.tolist() == [5, 0, 1, 2, 4, 5]
    assert tensors.logits_indices.tolist() == [0, 2, 3]
    assert model_input.sampling_seqs == [0, 1, 1]
    assert model_input.input_names == DECODER_INPUT_NAMES
    assert model_input.shapes["block_tables"] == (3, 2)


def test_host_values_arrays_and_tensors_agree_and_share_memory():
    model_input = pack_step(_step([[7, 2], [4], [1, 3]]), block_size=4)
    args = StepTensors(model_input).index_args()
    for name, arg in zip(model_input.input_names, args, strict=True):
        array = model_input.arrays[name]
        assert array.shape == model_input.shapes[name] == tuple(arg.shape), name
        assert array.tolist() == model_input.values[name] == arg.tolist(), name
        assert arg.data_ptr() == array.ctypes.data, name
    assert [a.dtype for a in args] == [torch.int64] * 3 + [torch.int32] * 3 + [torch.int64]
    moved = StepTensors(model_input, torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(moved.index_args(), args, strict=True))


def test_a_packed_step_does_not_change_when_its_sequences_grow():
    """The engine grows block lists in place: a kept input still holds the step's blocks."""
    blocks = [[7, 2], [4], [1, 3]]
    model_input = pack_step(_step(blocks), block_size=4)
    blocks[0].append(9)
    blocks[1][0] = 5
    assert model_input.values["block_tables"] == [[7, 2], [4, 0], [1, 3]]
    assert StepTensors(model_input).metadata.block_tables.tolist() == [[7, 2], [4, 0], [1, 3]]


def test_an_empty_step_has_a_one_wide_block_table():
    model_input = pack_step([], block_size=4)
    assert model_input.shapes["block_tables"] == (0, 1)
    assert model_input.arrays["block_tables"].shape == (0, 1)
    assert model_input.arrays["block_tables"].dtype == np.int32
    assert model_input.arrays["logits_indices"].tolist() == [-1]
