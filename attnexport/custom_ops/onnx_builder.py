"""The one way the project builds ONNX by hand: ``onnx_ir`` nodes, written as math.

``b.Add(x, y)`` appends an ``onnx_ir`` node and returns its output value, so a function body
reads like the math it computes. Inputs of the function being built are named by string
(``b.Shape("query")``); every other value is the ``ir.Value`` a call returned. onnx_ir's own
``Tape`` names values ``val_<n>``; this builder names them after their op
(``gather_12``, node ``n_Gather_13``) because onnxruntime quotes node names in its errors and
the bodies' refusals name their node (``invalid_<what>``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import onnx_ir as ir

FLOAT = ir.DataType.FLOAT
INT64 = ir.DataType.INT64
INT32 = ir.DataType.INT32
INT8 = ir.DataType.INT8
BOOL = ir.DataType.BOOL

ValueLike = ir.Value | str
"""A value a call returned, or the name of an input of the function being built."""

_ATTRIBUTE_KINDS = {
    "float": ("value_float", ir.AttributeType.FLOAT),
    "int": ("value_int", ir.AttributeType.INT),
}


class Builder:
    """Appends ``onnx_ir`` nodes; ``b.OpType(*inputs, **attributes)`` returns the output(s).

    ``outputs=n`` asks for ``n`` outputs (a list is returned); attributes are Python values
    (``int``, ``float``, ``list[int]``, ``ir.Graph`` ...); ``None`` attributes are left out.
    """

    def __init__(
        self,
        inputs: Sequence[str] = (),
        *,
        _values: dict[str, ir.Value] | None = None,
        _counter: itertools.count | None = None,
    ) -> None:
        self.nodes: list[ir.Node] = []
        self.inputs = [ir.Value(name=name) for name in inputs]
        self._values = _values if _values is not None else {v.name: v for v in self.inputs}
        self._counter = _counter if _counter is not None else itertools.count()

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._counter)}"

    def value(self, value: ValueLike) -> ir.Value:
        """``value`` itself, or the function input of that name."""
        if isinstance(value, str):
            try:
                return self._values[value]
            except KeyError:
                raise KeyError(f"{value!r} is not an input of the function being built") from None
        return value

    def op(
        self,
        op_type: str,
        *inputs: ValueLike | None,
        outputs: int = 1,
        names: Sequence[str] | None = None,
        node_hint: str | None = None,
        **attributes,
    ) -> ir.Value | list[ir.Value]:
        """Appends a node; ``names`` fixes its output names (else ``outputs`` fresh ones);
        ``node_hint`` starts the node's name (onnxruntime's errors quote it)."""
        if names is None:
            names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        values = [ir.Value(name=name) for name in names]
        node = ir.Node(
            "",
            op_type,
            [None if i is None else self.value(i) for i in inputs],
            # Sorted by name, as onnx.helper.make_node writes them (files stay byte-stable).
            attributes=ir.convenience.convert_attributes(
                {k: attributes[k] for k in sorted(attributes) if attributes[k] is not None}
            ),
            outputs=values,
            name=self.fresh(node_hint or f"n_{op_type}"),
        )
        self.nodes.append(node)
        return values[0] if len(values) == 1 else values

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attributes: self.op(op_type, *inputs, **attributes)

    # ------------------------------------------------------------------ constants

    def ints(self, values: Sequence[int]) -> ir.Value:
        """A 1-D int64 constant."""
        return self.op("Constant", value_ints=list(values))

    def int_scalar(self, value: int) -> ir.Value:
        return self.op("Constant", value_int=value)

    def float_scalar(self, value: float) -> ir.Value:
        return self.op("Constant", value_float=value)

    def attribute(self, name: str, kind: str) -> ir.Value:
        """A scalar constant holding the enclosing function's attribute ``name``.

        ``kind`` is ``"float"`` (float32 scalar) or ``"int"`` (int64 scalar).
        """
        attr_name, attr_type = _ATTRIBUTE_KINDS[kind]
        out = ir.Value(name=self.fresh(name))
        node = ir.Node(
            "",
            "Constant",
            [],
            attributes=[ir.RefAttr(attr_name, name, attr_type)],
            outputs=[out],
            name=self.fresh("n_Constant"),
        )
        self.nodes.append(node)
        return out

    # ------------------------------------------------------------------ control flow

    def branch(self) -> Builder:
        """A builder for an ``If`` branch; its values may read this builder's values."""
        return Builder(_values=self._values, _counter=self._counter)

    def graph(self, outputs: Sequence[ir.Value], name: str) -> ir.Graph:
        """This builder's nodes as a subgraph with ``outputs`` (types left to inference)."""
        return ir.Graph([], list(outputs), nodes=self.nodes, name=name)

    # ------------------------------------------------------------------ the function

    def function(
        self,
        name: str,
        domain: str,
        outputs: Sequence[str],
        opset: int,
        attributes: Mapping[str, float | int | None],
        doc: str = "",
    ) -> ir.Function:
        """A function of this builder's nodes: its inputs are the builder's ``inputs``, its
        ``outputs`` the values of those names; ``attributes`` maps names to defaults
        (``None``: required)."""
        produced = {v.name: v for node in self.nodes for v in node.outputs}
        graph = ir.Graph(
            self.inputs,
            [produced[o] for o in outputs],
            nodes=self.nodes,
            opset_imports={"": opset},
            name=name,
            doc_string=doc or None,
        )
        declared = [
            ir.Attr(k, ir.AttributeType.UNDEFINED, None)
            if v is None
            else ir.convenience.convert_attribute(k, v)
            for k, v in attributes.items()
        ]
        return ir.Function(domain, name, graph=graph, attributes=declared)


# --------------------------------------------------------------------------- body idioms

INT64_MAX = 2**63 - 1


def scalar(b: Builder, one_element: ValueLike) -> ir.Value:
    """A 0-D tensor from a 1-element 1-D one (Range wants scalars)."""
    return b.Squeeze(one_element, b.ints([0]))


def arange(b: Builder, length: ValueLike) -> ir.Value:
    """int64 [0, 1, ..., n - 1] for a 1-element int64 ``length``."""
    return b.Range(b.int_scalar(0), scalar(b, length), b.int_scalar(1))


def refuse_if(b: Builder, tensor: ValueLike, bad: Sequence[ValueLike], what: str) -> ir.Value:
    """``tensor`` itself when every element of the 1-D bool tensors ``bad`` is false; else the
    run fails. ONNX has no assert, but onnxruntime refuses a ``Gather`` index past the end: the
    count of bad elements indexes a 1-row copy of ``tensor``, in a node named
    ``invalid_<what>`` that onnxruntime's error quotes. Everything the checks guard reads the
    returned tensor, so onnxruntime cannot compute it (or allocate by it) before they ran."""
    flags = b.Concat(*bad, axis=0) if len(bad) > 1 else bad[0]
    count = b.ReduceSum(b.Cast(flags, to=INT64), keepdims=0)  # 0-D: Gather keeps the shape
    unsqueezed = b.Unsqueeze(tensor, b.ints([0]))
    return b.op("Gather", unsqueezed, count, axis=0, node_hint=f"invalid_{what}")


def differs(b: Builder, actual: ValueLike, expected: ValueLike) -> ir.Value:
    """1-D bool: true where the 1-D int64 ``actual`` and ``expected`` (shapes, or parts of
    them, of one length) differ."""
    return b.Not(b.Equal(actual, expected))
