"""``rule_matching``: multi-output rewrite rules matched from their first output's op only,
with the results of onnxscript's own matcher."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import onnxscript.optimizer
import pytest
from onnx import TensorProto, helper
from onnxscript import rewriter
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _basic_rules

from attnexport.lowering import rule_matching


def _two_slices_model(pairs: int) -> ir.Model:
    """``pairs`` independent ``x_i [2, 8]`` split in halves by two ``Slice`` each (what
    onnxscript's ``SlicesSplit`` rewrites into one ``Split``), each half through a ``Relu``.
    The upper half's ``Slice`` comes first: onnxscript's matcher keeps the first combination
    of nodes that has the pattern's shape (the lower half's ``Slice`` paired with itself, when
    it comes first) and then fails the rule's check."""
    nodes, inputs, outputs, initializers = [], [], [], []
    for name, values in (("lo", [0]), ("mid", [4]), ("hi", [8]), ("axis", [1])):
        initializers.append(helper.make_tensor(name, TensorProto.INT64, [1], values))
    for i in range(pairs):
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 8]))
        for half, (start, end) in ((1, ("mid", "hi")), (0, ("lo", "mid"))):
            nodes.append(helper.make_node("Slice", [f"x{i}", start, end, "axis"], [f"s{i}_{half}"]))
            nodes.append(helper.make_node("Relu", [f"s{i}_{half}"], [f"y{i}_{half}"]))
            outputs.append(helper.make_tensor_value_info(f"y{i}_{half}", TensorProto.FLOAT, [2, 4]))
    graph = helper.make_graph(nodes, "slices", inputs, outputs, initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.serde.deserialize_model(proto)


def _ops(model: ir.Model) -> list[str]:
    return [node.op_type for node in model.graph]


def test_the_optimizer_with_anchored_rules_writes_what_onnxscripts_writes():
    stock, anchored = _two_slices_model(3), _two_slices_model(3)
    onnxscript.optimizer.optimize_ir(stock)
    rule_matching.optimize(anchored)
    assert _ops(stock).count("Split") == 3  # SlicesSplit fired: the case is the multi-output one
    assert "Slice" not in _ops(stock)
    assert onnx.printer.to_text(ir.serde.serialize_model(anchored)) == onnx.printer.to_text(
        ir.serde.serialize_model(stock)
    )


def test_onnxscripts_default_rules_are_left_as_they_were():
    before = rewriter._DEFAULT_REWRITE_RULES
    matchers = [rule._matcher for rule in before]
    rule_matching.optimize(_two_slices_model(1))
    assert rewriter._DEFAULT_REWRITE_RULES is before
    assert [rule._matcher for rule in before] == matchers
    assert all(type(m) is pattern.SimplePatternMatcher for m in matchers)


def test_a_node_of_another_op_is_refused_before_the_graph_is_indexed():
    model = _two_slices_model(2)
    rule = rule_matching.anchored_rule(_basic_rules.SlicesSplit)
    relu = next(node for node in model.graph if node.op_type == "Relu")
    graph = model.graph
    indexed = []

    class CountingGraph:
        """The graph (as a function's graph), counting how often the matcher walks it."""

        graph = model.graph

        def __iter__(self):
            indexed.append(True)
            return iter(graph)

    result = rule._matcher.match(model, CountingGraph(), relu)
    assert not result
    assert "not a Slice node" in result.reason
    assert indexed == []


@pytest.mark.parametrize("pairs", [1, 4])
def test_anchored_rules_match_what_the_stock_rules_match(pairs):
    stock, anchored = _two_slices_model(pairs), _two_slices_model(pairs)
    count = pattern.RewriteRuleSet([_basic_rules.SlicesSplit.rule()]).apply_to_model(stock)
    anchored_count = pattern.RewriteRuleSet(
        [rule_matching.anchored_rule(_basic_rules.SlicesSplit)]
    ).apply_to_model(anchored)
    assert count == anchored_count == pairs
    assert _ops(anchored) == _ops(stock)


def _add_constant_model(op_type: str, constant: float) -> ir.Model:
    """``y = op_type(x, c)`` on ``x [2, 8]``, then ``Sqrt`` (so the graph is not empty)."""
    nodes = [
        helper.make_node(op_type, ["x", "c"], ["t"]),
        helper.make_node("Sqrt", ["t"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor("c", TensorProto.FLOAT, [], [constant])],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    return ir.serde.deserialize_model(proto)


@pytest.mark.parametrize("op_type, constant", [("Add", 1e-8), ("Mul", 1.000001), ("Sub", 1e-9)])
def test_an_epsilon_is_not_taken_for_a_no_op(op_type, constant):
    """Regression: onnxscript's no-op rules match ``x + 0`` within 1e-8 and ``x * 1`` within
    1e-5: its optimizer dropped the ``+ 1e-8`` of Helium's RMSNorm, and a zero row came out
    NaN. The lowering's optimizer keeps such a node; onnxscript's own drops it (the case is
    the one the fix is about)."""
    stock, ours = _add_constant_model(op_type, constant), _add_constant_model(op_type, constant)
    onnxscript.optimizer.optimize_ir(stock)
    rule_matching.optimize(ours)
    assert op_type not in _ops(stock)
    assert op_type in _ops(ours)


@pytest.mark.parametrize("op_type, constant", [("Add", 0.0), ("Mul", 1.0), ("Div", 1.0)])
def test_an_exact_no_op_is_still_removed(op_type, constant):
    model = _add_constant_model(op_type, constant)
    rule_matching.optimize(model)
    assert _ops(model) == ["Sqrt"]
