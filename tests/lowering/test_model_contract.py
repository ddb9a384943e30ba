"""What the file says about itself: its graph contract (metadata_props), readable dimension
names, input/output names, IR version and the ONNX checker."""

from __future__ import annotations

import json

import onnx
import onnxruntime as ort
import pytest
import torch

from attnexport import lowering
from attnexport._version import __version__
from attnexport.lowering import GraphContract, export_program, read_contract, to_onnx
from attnexport.model_interface import CacheSpec
from tests.lowering.modules import AttentionStack, LayerOptions, StepPlanner

BLOCK_SIZE = 4


def _stack_args(model: AttentionStack) -> tuple:
    step = StepPlanner(8, BLOCK_SIZE).step({0: 3, 1: 5})
    tokens = int(step["query_start_loc"][-1])
    hidden = torch.randn(tokens, 24)
    caches = [torch.zeros(8, BLOCK_SIZE, 2, 8) for _ in range(2 * len(model.layers))]
    return (hidden, hidden.clone(), *step.values(), caches)


def _dims(value_info) -> list:
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    model = AttentionStack([LayerOptions(), LayerOptions(alibi=True)])
    path = tmp_path_factory.mktemp("meta") / "stack.onnx"
    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4)
    proto = to_onnx(
        model,
        _stack_args(model),
        path,
        cache_spec=spec,
        metadata={"architecture": "toy-stack"},
        output_names=["hidden_out"],
    )
    return proto, path


def test_metadata_props(exported):
    proto, _ = exported
    props = {p.key: p.value for p in proto.metadata_props}
    caches = [f"kv_caches_{i}" for i in range(4)]
    assert props == {
        "attnexport_version": __version__,
        "attnexport_domain": "attnexport:1",
        "target": "attnexport",
        "cache_layout": "num_blocks,block_size,num_kv_heads,head_size",
        "block_size": "4",
        "num_layers": "2",
        "num_kv_heads": "2",
        "head_size": "8",
        "dtype": "float32",
        "cache_inputs": json.dumps(caches),
        "cache_outputs": json.dumps({c: f"{c}_out" for c in caches}),
        "outputs": json.dumps(["hidden_out"]),
        "architecture": "toy-stack",
        "fusions": json.dumps({"sibling_matmuls": 2}),  # its separate q/k/v projections
    }


def test_contract_reads_back_from_proto_path_and_session(exported):
    proto, path = exported
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    parsed = [read_contract(proto), read_contract(path), read_contract(session)]
    assert parsed[0] == parsed[1] == parsed[2]
    assert parsed[0].num_layers == 2 and parsed[0].block_size == 4
    assert parsed[0].extra == {"architecture": "toy-stack"}
    assert GraphContract.from_props(parsed[0].to_props()) == parsed[0]


def test_earlier_names_of_the_contract_still_resolve():
    assert lowering.ModelMetadata is GraphContract
    assert lowering.read_metadata is read_contract


def test_names_and_dimensions(exported):
    proto, _ = exported
    inputs = {i.name: _dims(i) for i in proto.graph.input}
    assert inputs == {
        "hidden": ["num_tokens", 24],
        "key_states": ["num_tokens_2", 24],  # its own symbol: keys may have padding rows
        "slot_mapping": ["num_tokens_2"],
        "block_tables": ["num_seqs", "max_blocks_per_seq"],
        "seq_lens": ["num_seqs"],
        "query_start_loc": ["num_seqs + 1"],
        # Automatic shapes do not tie the layers' pools together (no Dim says so).
        **{f"kv_caches_{i}": ["num_blocks", 4, 2, 8] for i in range(2)},
        **{f"kv_caches_{i}": ["num_blocks_2", 4, 2, 8] for i in range(2, 4)},
    }
    outputs = {o.name: _dims(o) for o in proto.graph.output}
    assert list(outputs) == ["hidden_out", *(f"kv_caches_{i}_out" for i in range(4))]
    assert outputs["hidden_out"] == ["num_tokens", 24]


def test_file_is_valid_for_the_installed_onnxruntime(exported):
    proto, path = exported
    onnx.checker.check_model(str(path), full_check=True)
    assert proto.ir_version == 10
    assert {o.domain: o.version for o in proto.opset_import} == {"": 18, "attnexport": 1}


def test_named_dims_from_the_caller_win(tmp_path):
    model = AttentionStack([LayerOptions()])
    args = _stack_args(model)
    dim = torch.export.Dim
    tokens, keys, seqs = dim("batch_tokens"), dim("key_rows"), dim("batch_seqs")
    shapes = (
        {0: tokens},
        {0: keys},
        {0: keys},
        {0: seqs, 1: dim("table_width")},
        {0: seqs},
        {0: seqs + 1},
        [{0: dim("pool_blocks")}] * 2,
    )
    program = export_program(model, args, dynamic_shapes=shapes)
    proto = to_onnx(program, args, tmp_path / "m.onnx")
    inputs = {i.name: _dims(i)[0] for i in proto.graph.input}
    assert inputs == {
        "hidden": "batch_tokens",
        "key_states": "key_rows",
        "slot_mapping": "key_rows",
        "block_tables": "batch_seqs",
        "seq_lens": "batch_seqs",
        "query_start_loc": "batch_seqs + 1",
        "kv_caches_0": "pool_blocks",
        "kv_caches_1": "pool_blocks",
    }


def test_metadata_errors(tmp_path):
    model = AttentionStack([LayerOptions()])
    args = _stack_args(model)
    wrong = CacheSpec(num_layers=1, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=8)
    with pytest.raises(
        ValueError, match="cache_spec: block_size is 8 but the sample caches have 4"
    ):
        to_onnx(model, args, tmp_path / "m.onnx", cache_spec=wrong)
    with pytest.raises(ValueError, match=r"metadata: keys \['target'\] are written by attnexport"):
        to_onnx(model, args, tmp_path / "m.onnx", metadata={"target": "mine"})


def test_rope_switch_length_is_a_contract_key_absent_when_none():
    """A LongRoPE model's switch length is written under its own key and read back; a file
    without it (any other model, older exports) reads as None, not as an extra key."""
    contract = GraphContract(target="attnexport", rope_switch_length=4096)
    props = contract.to_props()
    assert props["rope_switch_length"] == "4096"
    assert GraphContract.from_props(props) == contract
    assert GraphContract.from_props(props).extra == {}
    del props["rope_switch_length"]
    assert GraphContract.from_props(props).rope_switch_length is None
