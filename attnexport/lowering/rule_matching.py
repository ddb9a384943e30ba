"""onnxscript's rewrite rules as the lowering runs them: those of several output nodes
matched in linear time, the no-op ones on exact constants.

onnxscript's ``SimplePatternMatcher`` (0.7.2) matches a pattern of several output nodes (a
``Split`` and its consumers, two ``Slice`` of one tensor) from every node of the graph it
visits: it first indexes the whole graph by op type, then tries every combination of
candidates for the other outputs, even when the visited node's op is not the first output
node's and nothing can match. A rule pass is thus quadratic in the graph's nodes. On the
transformers path's SmolLM2-135M graph (3,700 nodes before the optimizer) that was 3.2 s per
optimizer iteration for onnxscript's own ``SlicesSplit`` rule and 6.1 s for ``qkv_rotary``:
a third of the export. :class:`AnchoredMatcher` refuses such a node before indexing; what it
matches is what onnxscript's matcher matches (the first output node must match the visited
node in both).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import onnx_ir as ir
from onnxscript import rewriter
from onnxscript.rewriter import pattern


class AnchoredMatcher(pattern.SimplePatternMatcher):
    """``SimplePatternMatcher`` that, for a pattern of several output nodes, matches only from
    a node of the first output node's op (onnxscript's checks that op after indexing the
    graph and trying the other outputs' candidates)."""

    def match(
        self,
        model: ir.Model,
        graph_or_function: ir.Graph | ir.Function,
        node: ir.Node,
        *,
        verbose: int = 0,
        remove_nodes: bool = True,
        tracer: pattern.MatchingTracer | None = None,
    ) -> pattern.MatchResult:
        if not self.pattern.has_single_output_node:
            anchor = self.pattern.output_nodes[0].op_identifier()
            if anchor is not None and node.op_identifier() != anchor:
                return pattern.MatchResult().fail(f"not a {anchor[1]} node")
        return super().match(
            model,
            graph_or_function,
            node,
            verbose=verbose,
            remove_nodes=remove_nodes,
            tracer=tracer,
        )


def anchored_rule(rule_class: type[pattern.RewriteRuleClassBase]) -> pattern.RewriteRule:
    """``rule_class.rule()`` matched by :class:`AnchoredMatcher` (its commuted variants too:
    onnxscript builds them with the rule's matcher class)."""
    instance = rule_class()
    return pattern.RewriteRule(
        instance.pattern,
        instance.rewrite,
        instance.check,
        matcher=AnchoredMatcher,
        name=instance.name,
        remove_nodes=instance.remove_nodes,
        graph_pre_visitor=instance.setup,
        graph_post_visitor=instance.cleanup,
        as_function=instance.as_function,
    )


def _anchored_copy(rule: pattern.RewriteRule) -> pattern.RewriteRule:
    """A copy of onnxscript's ``rule`` matched by :class:`AnchoredMatcher` (the rule itself,
    shared by every caller of onnxscript, is left as it is)."""
    matcher = getattr(rule, "_matcher", None)
    target = getattr(rule, "_target_pattern", None)
    if type(matcher) is not pattern.SimplePatternMatcher or target is None:
        return rule
    clone = copy.copy(rule)
    clone._matcher = AnchoredMatcher(target)
    return clone


def _exact(value: float) -> pattern.Constant:
    return pattern.Constant(value, rel_tol=0.0, abs_tol=0.0)


def _mul_by_1(op, x):
    return op.Mul(x, _exact(1))


def _add_0(op, x):
    return op.Add(x, _exact(0))


def _sub_0(op, x):
    return op.Sub(x, _exact(0))


def _div_by_1(op, x):
    return op.Div(x, _exact(1))


def _identity(op, x, **_):
    return op.Identity(x)


def _exact_no_op_rules() -> list[pattern.RewriteRule]:
    """``x * 1``, ``x + 0``, ``x - 0``, ``x / 1`` -> ``x`` for those constants exactly.
    onnxscript's own no-op rules match their constants within 1e-8 (absolute) and 1e-5
    (relative): they dropped the ``+ 1e-8`` of Helium's RMSNorm, whose padding row (zeros) then
    came out NaN (``rsqrt(0)`` times 0), and would drop a scale of ``1 + 1e-6``."""
    rules = []
    for target in (_mul_by_1, _add_0):
        rules.extend(pattern.RewriteRule(target, _identity).commute())
    rules.extend(pattern.RewriteRule(target, _identity) for target in (_sub_0, _div_by_1))
    return rules


def _optimizer_rules(default: tuple) -> tuple:
    """onnxscript's default rules, its approximate no-op ones replaced by exact ones and the
    multi-output ones matched by :class:`AnchoredMatcher`."""
    try:
        from onnxscript.rewriter.rules.common import _no_op

        no_op_rules = _no_op.rules.rules
    except (ImportError, AttributeError):
        # an onnxscript laid out otherwise: its no-op rules stay, after the exact ones
        no_op_rules = []
    # its no-op rules on a constant (x * 1, x + 0, x - 0, x / 1; not the Dropout ones)
    approximate = {
        id(rule)
        for rule in no_op_rules
        if any(
            isinstance(value, pattern.Constant)
            for node in getattr(rule, "_target_pattern", ())
            for value in node.inputs
        )
    }
    kept = [rule for rule in default if id(rule) not in approximate]
    return (*_exact_no_op_rules(), *(_anchored_copy(rule) for rule in kept))


@contextlib.contextmanager
def _lowering_default_rules() -> Iterator[None]:
    """onnxscript's default rewrite rules (which ``optimize_ir`` reads when it runs) as
    :func:`_optimizer_rules` makes them, for the duration; an onnxscript without that tuple is
    left alone (its optimizer then runs as it would)."""
    default = getattr(rewriter, "_DEFAULT_REWRITE_RULES", None)
    if not isinstance(default, tuple):
        yield
        return
    rewriter._DEFAULT_REWRITE_RULES = _optimizer_rules(default)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = default


def optimize(model: ir.Model) -> None:
    """onnxscript's optimizer (``optimize_ir``, in place) with its no-op rules exact and its
    multi-output rules matched by :class:`AnchoredMatcher` (:func:`_optimizer_rules`)."""
    import onnxscript.optimizer

    with _lowering_default_rules():
        onnxscript.optimizer.optimize_ir(model)
