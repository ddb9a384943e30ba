"""A small builder for ONNX function bodies: ``b.Add(x, y)`` appends a node and returns the
name of its output, so a body reads like the math it computes.

Only what the attnexport bodies need: standard-domain nodes with generated value names,
constants, constants that reference an attribute of the enclosing function (``ref_attr_name``),
and ``If`` branches built by a child builder that shares the name counter.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import onnx
from onnx import AttributeProto, TensorProto, helper


class Builder:
    """Appends nodes to a list; ``b.OpType(*inputs, **attributes)`` returns the output name(s).

    ``outputs=n`` asks for ``n`` outputs (a list is returned); attributes are Python values
    (``int``, ``float``, ``list[int]``, ``onnx.GraphProto``...).
    """

    def __init__(self, prefix: str = "", counter: itertools.count | None = None) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._prefix = prefix
        self._counter = counter if counter is not None else itertools.count()

    def fresh(self, hint: str) -> str:
        return f"{self._prefix}{hint}_{next(self._counter)}"

    def op(
        self,
        op_type: str,
        *inputs: str,
        outputs: int = 1,
        names: Sequence[str] | None = None,
        node_hint: str | None = None,
        **attributes,
    ) -> str | list[str]:
        """Appends a node; ``names`` fixes its output names (else ``outputs`` fresh ones);
        ``node_hint`` starts the node's name (onnxruntime's errors quote it)."""
        if names is None:
            names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        names = list(names)
        self.nodes.append(
            helper.make_node(
                op_type,
                list(inputs),
                names,
                name=self.fresh(node_hint or f"n_{op_type}"),
                **{k: v for k, v in attributes.items() if v is not None},
            )
        )
        return names[0] if len(names) == 1 else names

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attributes: self.op(op_type, *inputs, **attributes)

    # ------------------------------------------------------------------ constants

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant."""
        return self.op("Constant", value_ints=list(values))

    def int_scalar(self, value: int) -> str:
        return self.op("Constant", value_int=value)

    def float_scalar(self, value: float) -> str:
        return self.op("Constant", value_float=value)

    def tensor(self, value: float, dtype: int) -> str:
        """A 1-element, 1-D constant of ONNX element type ``dtype``."""
        return self.op("Constant", value=helper.make_tensor("value", dtype, [1], [value]))

    def attribute(self, name: str, kind: str) -> str:
        """A scalar constant holding the enclosing function's attribute ``name``.

        ``kind`` is ``"float"`` (float32 scalar) or ``"int"`` (int64 scalar).
        """
        attr_name, attr_type = {
            "float": ("value_float", AttributeProto.FLOAT),
            "int": ("value_int", AttributeProto.INT),
        }[kind]
        out = self.fresh(name)
        node = helper.make_node("Constant", [], [out], name=self.fresh("n_Constant"))
        node.attribute.append(helper.make_attribute_ref(attr_name, attr_type, ref_attr_name=name))
        self.nodes.append(node)
        return out

    # ------------------------------------------------------------------ control flow

    def branch(self) -> Builder:
        """A builder for an ``If`` branch; its values may read this builder's values."""
        return Builder(self._prefix, self._counter)

    def graph(self, outputs: Sequence[str], name: str) -> onnx.GraphProto:
        """This builder's nodes as a subgraph with ``outputs`` (types left to inference)."""
        return helper.make_graph(
            self.nodes, name, [], [helper.make_value_info(o, onnx.TypeProto()) for o in outputs]
        )


def function(
    builder: Builder,
    name: str,
    domain: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    opset: int,
    attributes: dict[str, float | int | None],
    doc: str = "",
) -> onnx.FunctionProto:
    """A FunctionProto of ``builder``'s nodes. ``attributes`` maps names to defaults (``None``:
    required)."""
    required = [k for k, v in attributes.items() if v is None]
    defaults = [helper.make_attribute(k, v) for k, v in attributes.items() if v is not None]
    return helper.make_function(
        domain,
        name,
        list(inputs),
        list(outputs),
        builder.nodes,
        [helper.make_opsetid("", opset)],
        attributes=required,
        attribute_protos=defaults,
        doc_string=doc,
    )


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL
