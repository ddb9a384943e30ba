"""The ONNX face of an op slice: one :class:`OnnxOp` per ``attnexport``-domain node.

Each ``attnexport/custom_ops/<slice>/onnx.py`` exposes ``ONNX_OPS``, a tuple of these. The
lowering iterates :data:`~attnexport.custom_ops.slices.OP_SLICES` and builds every registry
from them: the ``onnx.defs`` schemas, the torch.onnx translation table, the function bodies,
which torch-op arguments are KV caches, the dimension names of the inputs and the static
geometry attributes. Only the lowering imports these modules (they need onnx, onnx_ir and
onnxscript; ``import attnexport.custom_ops`` does not load them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import onnx
import onnx_ir as ir
from onnx.defs import OpSchema

from attnexport.custom_ops.onnx_builder import Builder
from attnexport.model_contract import DOMAIN, DOMAIN_VERSION

FLOAT_TYPES = ("tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)")
CACHE_TYPES = (*FLOAT_TYPES, "tensor(int8)")
"""The KV cache element types: any float type, or int8 with float32 scale caches."""
CACHE_TYPE_CONSTRAINT = ("C", CACHE_TYPES, "KV cache dtype (int8: with float32 scale caches).")
SCALE_TYPE_CONSTRAINT = ("F", ("tensor(float)",), "Scale cache type (float32).")

TOKENS = "num_tokens"

Dim = Callable[[str, int], int]
"""``dim(input name, axis)``: a static dimension of one of the node's inputs."""


@dataclass(frozen=True)
class Port:
    """An input or output of a node. An input that names dimensions or is a cache is the torch
    op's argument of the same position: the lowering looks those up by index."""

    name: str
    type: str
    """Its type-constraint letter (``T``, ``I``...)."""
    doc: str
    optional: bool = False
    dims: tuple[str, ...] = ()
    """The names the exporter gives the graph input this port reads (``num_tokens``...);
    empty: the port names no dimension."""
    cache: bool = False
    """A paged KV cache: must be a graph input, read (and, for a write, updated) in place."""
    scale: bool = False
    """A scale cache of int8 KV caches: present iff the caches are int8 (a model has one cache
    dtype, so its nodes all have these inputs or none); a graph input read (and, for a write,
    updated) in place like a cache. Looked up in the torch op by name, not position."""
    sinks: bool = False
    """Attention sinks: present iff the model's attention has them (its nodes all have the
    input or none); the last input, after the scale caches."""


_CACHE_DIMS = ("num_blocks", "block_size", "num_kv_heads", "head_size")
CACHES = tuple(
    Port(name, "C", f"[{', '.join(_CACHE_DIMS)}]", dims=_CACHE_DIMS, cache=True)
    for name in ("key_cache", "value_cache")
)
"""The key and value cache ports of a paged node (the layout of docs/ops.md)."""


def scale_caches(names: bool) -> tuple[Port, Port]:
    """The optional key and value scale-cache ports of a paged node: float32
    ``[num_blocks, block_size, num_kv_heads]``, present iff the caches are int8. ``names``:
    the ports name their dims (where a port's index is its torch argument's too)."""
    return tuple(
        Port(
            name,
            "F",
            f"[num_blocks, block_size, num_kv_heads] float32 scale of each {kind} cache row "
            "(int8 caches only; row = float(q) * scale)",
            optional=True,
            dims=_CACHE_DIMS[:3] if names else (),
            scale=True,
        )
        for name, kind in (("key_scale_cache", "key"), ("value_scale_cache", "value"))
    )


@dataclass(frozen=True)
class Attribute:
    """A scalar attribute of a node (schema and function body alike)."""

    name: str
    kind: str
    """``"float"`` or ``"int"``."""
    doc: str
    default: float | int | None = None
    """``None``: required."""


@dataclass(frozen=True)
class OnnxOp:
    """One ``attnexport``-domain node and the torch ops that lower to it."""

    node: str
    """The node's op_type in :data:`DOMAIN` (public: files depend on it)."""
    doc: str
    summary: str
    """The function body's one-line doc."""
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    type_constraints: tuple[tuple[str, tuple[str, ...], str], ...]
    attributes: tuple[Attribute, ...]
    torch_op: str
    """The functional ``torch.ops.attnexport`` op translated to this node; its arguments
    start with :attr:`inputs`, in order."""
    translate: Callable
    """The onnxscript translation of :attr:`torch_op` (``custom_translation_table``)."""
    body: Callable[[Builder], None]
    """Writes the node's standard-op body: reads the inputs by name, names the outputs."""
    geometry: Callable[[Dim], dict[str, int]] = lambda dim: {}
    """The static geometry attributes the exporter derives from the input shapes."""
    in_place_op: str | None = None
    """A torch op that writes the caches in place and is rewritten to :attr:`torch_op`
    before the translation (torch.onnx cannot lower in-place custom ops)."""
    scaled_body: Callable[[Builder], None] | None = None
    """The body of a node with its scale-cache inputs (int8 caches); :attr:`body` is that of a
    node without them (float caches). An ONNX function body cannot test for an omitted input,
    so a model gets the variant its cache dtype needs (:meth:`function`)."""

    @property
    def cache_inputs(self) -> tuple[int, ...]:
        """Indices of the cache inputs; a writing node's outputs are their new values."""
        return tuple(i for i, port in enumerate(self.inputs) if port.cache)

    @property
    def scale_inputs(self) -> tuple[int, ...]:
        """Indices of the optional scale-cache inputs (int8 caches)."""
        return tuple(i for i, port in enumerate(self.inputs) if port.scale)

    @property
    def state_inputs(self) -> tuple[int, ...]:
        """Indices of every input updated in place by a writing node, in input order: the
        caches, then the scale caches (a writing node's outputs are their new values, the
        scale caches' only when the node has them)."""
        return (*self.cache_inputs, *self.scale_inputs)

    @property
    def writes_caches(self) -> bool:
        return self.in_place_op is not None

    def schema(self) -> OpSchema:
        """The ``onnx.defs`` schema of the node."""

        def param(port: Port) -> OpSchema.FormalParameter:
            option = OpSchema.FormalParameterOption
            kind = option.Optional if port.optional else option.Single
            return OpSchema.FormalParameter(port.name, port.type, port.doc, param_option=kind)

        def attribute(a: Attribute) -> OpSchema.Attribute:
            if a.default is None:
                kind = {"float": OpSchema.AttrType.FLOAT, "int": OpSchema.AttrType.INT}[a.kind]
                return OpSchema.Attribute(a.name, kind, a.doc, required=True)
            value = onnx.helper.make_attribute(a.name, a.default)
            return OpSchema.Attribute(a.name, value, a.doc)

        return OpSchema(
            self.node,
            DOMAIN,
            DOMAIN_VERSION,
            doc=self.doc,
            inputs=[param(p) for p in self.inputs],
            outputs=[param(p) for p in self.outputs],
            type_constraints=[(t, list(types), doc) for t, types, doc in self.type_constraints],
            attributes=[attribute(a) for a in self.attributes],
        )

    def function(self, opset: int, scaled: bool = False, sinks: bool = False) -> ir.Function:
        """The node's standard-op body for a model of standard opset ``opset``; ``scaled``:
        the variant for int8 caches (with the scale-cache inputs and outputs), else the one
        for float caches (without them); ``sinks``: with the attention-sink input, which then
        follows the scale-cache inputs, unused without int8 caches (a function's inputs are
        bound by position)."""
        body = self.scaled_body if scaled and self.scaled_body is not None else self.body
        keep = scaled and self.scaled_body is not None
        sinks = sinks and any(p.sinks for p in self.inputs)
        b = Builder(
            [
                p.name
                for p in self.inputs
                if (keep or sinks or not p.scale) and (sinks or not p.sinks)
            ]
        )
        body(b)
        return b.function(
            self.node,
            DOMAIN,
            [p.name for p in self.outputs if keep or not p.scale],
            opset,
            {a.name: a.default for a in self.attributes},
            doc=self.summary,
        )

    def has_scales(self, inputs: list) -> bool:
        """Whether a node of this op with ``inputs`` (``None`` or ``""`` for a missing one)
        has its scale-cache inputs."""
        return any(
            port.scale and i < len(inputs) and inputs[i] not in (None, "")
            for i, port in enumerate(self.inputs)
        )

    def input_dims(self) -> Mapping[int, tuple[str, ...]]:
        """``{input index: dimension names}`` of the inputs that name dimensions."""
        return {i: p.dims for i, p in enumerate(self.inputs) if p.dims}


def traced_dims(**values) -> Dim:
    """The :data:`Dim` of a translation: ``values`` are the traced inputs by port name; the
    dimension asked for must be static (the nodes take it as an attribute)."""

    def dim(name: str, axis: int) -> int:
        shape = getattr(values[name], "shape", None)
        size = shape[axis] if shape is not None and -len(shape) <= axis < len(shape) else None
        if not isinstance(size, int):
            raise ValueError(
                f"{name}: expected a static dimension {axis} for the ONNX export, got {size!r} "
                f"(shape {shape}); heads, head size and block size cannot be dynamic"
            )
        return size

    return dim


def attnexport_opset():
    """The onnxscript opset of :data:`DOMAIN`, whose ops the translations call (the schemas
    must be registered before a translation runs, see :mod:`attnexport.lowering.registry`)."""
    from onnxscript.values import Opset

    return Opset(DOMAIN, DOMAIN_VERSION)
