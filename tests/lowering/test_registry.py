"""The ONNX faces of the op slices agree with their torch faces, and the registries the lowering
builds from them are complete: the lowering relies on argument positions (cache arguments,
dimension names), so a face that drifted from its op would silently name or expose the wrong
input."""

from __future__ import annotations

import subprocess
import sys

import onnx
import onnx_ir as ir
import pytest
import torch

from attnexport.custom_ops.slices import OP_SLICES
from attnexport.lowering.registry import (
    DOMAIN,
    all_bodies,
    onnx_ops,
    register_schemas,
    torch_op_specs,
    translation_table,
)

SPECS = list(onnx_ops().values())


def _arguments(op_name: str) -> list[str]:
    return [a.name for a in getattr(torch.ops.attnexport, op_name).default._schema.arguments]


def test_every_slice_has_an_onnx_face():
    assert len(SPECS) == len(OP_SLICES)
    assert [s.node for s in SPECS] == [
        "ReshapeAndCache",
        "PagedAttention",
        "VarlenAttention",
        "NeoxRotaryEmbedding",
        "NeoxQKVRotaryEmbedding",
        "SiluAndMul",
        "FusedAddRMSNorm",
    ]
    ops = torch.ops.attnexport
    assert set(translation_table()) == {getattr(ops, s.torch_op).default for s in SPECS}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.node)
def test_ports_that_the_lowering_reads_by_position_match_the_torch_arguments(spec):
    """Cache ports and ports that name dimensions are looked up by index in the torch op's
    arguments (and in its in-place twin's)."""
    ops = [spec.torch_op, *([spec.in_place_op] if spec.in_place_op else [])]
    for op_name in ops:
        arguments = _arguments(op_name)
        for index, port in enumerate(spec.inputs):
            if port.cache or port.dims:
                assert arguments[index] == port.name, (op_name, index)


_SCALED = ("ReshapeAndCache", "PagedAttention")


def test_cache_arguments_are_the_paged_ops_caches():
    caches = {
        name: ([spec.inputs[i].name for i in spec.cache_inputs], in_place)
        for name, (spec, in_place) in torch_op_specs().items()
        if spec.cache_inputs
    }
    pair = ["key_cache", "value_cache"]
    assert caches == {
        "reshape_and_cache_functional": (pair, False),
        "reshape_and_cache": (pair, True),
        "paged_attention": (pair, False),
    }


_SINKS = ("PagedAttention",)
_VARIANTS = [
    (body, scaled, sinks)
    for scaled, sinks in ((False, False), (True, False), (False, True), (True, True))
    for body in all_bodies(18, scaled=scaled, sinks=sinks)
    if (not scaled or body.name in _SCALED) and (not sinks or body.name in _SINKS)
]


@pytest.mark.parametrize(
    ("body", "scaled", "sinks"),
    _VARIANTS,
    ids=[f"{b.name}-{len(b.inputs)}{'-sinks' * sinks}" for b, _, sinks in _VARIANTS],
)
def test_bodies_implement_their_schemas(body: ir.Function, scaled: bool, sinks: bool):
    """Each body takes the schema's inputs and makes its outputs; the float-cache variant of a
    node with optional scale-cache ports leaves those out (int8 caches have a body of their
    own: an ONNX function body cannot test for an omitted input), unless it has the
    attention-sink input, which comes after them (inputs are bound by position)."""
    register_schemas()
    schema = onnx.defs.get_schema(body.name, 1, DOMAIN)
    ports = {p.name: p for p in (*onnx_ops()[body.name].inputs, *onnx_ops()[body.name].outputs)}

    def expected(params, inputs: bool):
        return [
            p.name
            for p in params
            if (scaled or (sinks and inputs) or not ports[p.name].scale)
            and (sinks or not ports[p.name].sinks)
        ]

    assert [i.name for i in body.inputs] == expected(schema.inputs, inputs=True)
    assert [o.name for o in body.outputs] == expected(schema.outputs, inputs=False)
    assert set(body.attributes) == set(schema.attributes)
    for name, attribute in body.attributes.items():
        default = schema.attributes[name].default_value
        has_default = default.type != onnx.AttributeProto.UNDEFINED
        assert (attribute.value is not None) == has_default, name
        if has_default:
            assert attribute.value == onnx.helper.get_attribute_value(default), name
    onnx.checker.check_function(ir.serde.serialize_function(body))


def test_int8_cache_ports_are_optional_and_trailing():
    for name in _SCALED:
        spec = onnx_ops()[name]
        scales = [p for p in spec.inputs if p.scale]
        assert [p.name for p in scales] == ["key_scale_cache", "value_scale_cache"]
        inputs = [p for p in spec.inputs if not p.sinks]  # the sinks come after them
        assert all(p.optional for p in scales) and tuple(inputs[-2:]) == tuple(scales)
        assert spec.scaled_body is not None


def test_importing_the_ops_loads_no_onnx():
    code = (
        "import sys, attnexport.custom_ops\n"
        "roots = ('onnx', 'onnx_ir', 'onnxscript', 'onnxruntime')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in roots\n"
        "       or m.startswith('attnexport.lowering') or m.endswith('.onnx')]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
