"""Passes on the ExportedProgram: cache checks and the in-place -> functional rewrite.

* :func:`check_program` — which forward inputs the attnexport ops
  use as KV caches, and clear errors when a cache is a module buffer or constant (torch.onnx
  would bake it into the file), when a cache is written through a view, or when a forward input
  is modified in place by something other than ``attnexport::reshape_and_cache``.
* :func:`functionalize_cache_writes` — torch.onnx cannot lower an in-place custom op
  (docs/traps.md), so each ``reshape_and_cache`` becomes
  ``reshape_and_cache_functional`` plus ``aten.copy_`` of the results into the caches; the
  copies turn into input mutations when torch.onnx functionalizes the program.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature, InputKind

from attnexport.lowering.registry import torch_op_specs


def torch_argument_index(overload, port_name: str, port_index: int) -> int:
    """The index of the torch op's argument that node input ``port_name`` (at node index
    ``port_index``) is: the argument of that name, else the one at the same position."""
    names = [argument.name for argument in overload._schema.arguments]
    return names.index(port_name) if port_name in names else port_index


def _cache_arguments() -> dict:
    """``{op overload: (((argument index, argument name), ...) of its cache arguments (scale
    caches included), whether it writes them in place)}``, from the slices' ONNX faces."""
    ops = torch.ops.attnexport
    arguments = {}
    for name, (spec, in_place) in torch_op_specs().items():
        if not spec.state_inputs:
            continue
        overload = getattr(ops, name).default
        ports = [(spec.inputs[i].name, i) for i in spec.state_inputs]
        indexed = tuple((torch_argument_index(overload, n, i), n) for n, i in ports)
        arguments[overload] = (indexed, in_place)
    return arguments


def _functional_twins() -> dict:
    """``{in-place op overload: (its functional twin's overload, its cache argument indices)}``;
    the twin returns the written caches in that order (the scale caches only when given)."""
    ops = torch.ops.attnexport
    twins = {}
    for name, (spec, in_place) in torch_op_specs().items():
        if in_place:
            overload = getattr(ops, name).default
            indices = tuple(
                torch_argument_index(overload, spec.inputs[i].name, i) for i in spec.state_inputs
            )
            twins[overload] = (getattr(ops, spec.torch_op).default, indices)
    return twins


_CONSTANT_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant tensor attribute",
}


def node_argument(node: torch.fx.Node, index: int):
    """Argument ``index`` of an OpOverload call node, whether passed by position or keyword."""
    if len(node.args) > index:
        return node.args[index]
    argument = node.target._schema.arguments[index]
    return node.kwargs.get(argument.name, argument.default_value)


@dataclass(frozen=True)
class CacheInputs:
    """Forward inputs that the attnexport ops use as KV caches, in forward order."""

    inputs: tuple[str, ...]
    """Every cache input (read or written)."""
    written: tuple[str, ...]
    """The cache inputs that ``reshape_and_cache`` writes."""


def _user_inputs(ep: ExportedProgram) -> list[str]:
    return [
        spec.arg.name
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name")
    ]


def _op_label(node: torch.fx.Node) -> str:
    return str(node.target).removesuffix(".default")


def _check_cache_argument(ep: ExportedProgram, node, source, role: str, written: bool) -> None:
    specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}
    if source.op == "placeholder" and specs[source.name].kind in _CONSTANT_KINDS:
        spec = specs[source.name]
        raise ValueError(
            f"{_op_label(node)}: {role} is the module {_CONSTANT_KINDS[spec.kind]} "
            f"'{spec.target}', which the export would bake into the graph as a constant; pass "
            f"KV caches as explicit forward inputs (see attnexport.model_interface)"
        )
    if source.op == "get_attr":
        raise ValueError(
            f"{_op_label(node)}: {role} is the module attribute '{source.target}', which the "
            f"export would bake into the graph as a constant; pass KV caches as explicit "
            f"forward inputs (see attnexport.model_interface)"
        )
    if written and source.op != "placeholder":
        raise ValueError(
            f"{_op_label(node)}: {role} is '{source.name}', computed inside the model (a view or "
            f"copy of an input), not a forward input itself; a written cache must be its own "
            f"forward input so that the ONNX graph can update it in place"
        )


def _view_base(value):
    """The tensor a chain of view ops (select, slice, view, ...) starts from."""
    while isinstance(value, torch.fx.Node) and isinstance(value.target, torch._ops.OpOverload):
        returns = value.target._schema.returns
        alias = returns[0].alias_info if returns else None
        if alias is None or alias.is_write or not value.args:
            break
        value = value.args[0]
    return value


def _check_foreign_mutations(ep: ExportedProgram, user_inputs: set[str]) -> None:
    """Raises if a forward input is modified in place by an op other than ours."""
    ours = _cache_arguments()
    for node in ep.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target in ours:
            continue
        for index, argument in enumerate(target._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = _view_base(node_argument(node, index))
            if isinstance(value, torch.fx.Node) and value.name in user_inputs:
                raise ValueError(
                    f"forward input '{value.name}' is modified in place by {target}; the ONNX "
                    f"graph can only expose cache writes made by attnexport::reshape_and_cache"
                )


def check_program(ep: ExportedProgram) -> CacheInputs:
    """Checks that ``ep`` can be lowered with in-place cache updates; returns its caches.

    Raises:
        ValueError: a cache is a module parameter/buffer/constant, a written cache is not a
            forward input itself, or an input is modified in place by another op.
    """
    user_inputs = _user_inputs(ep)
    used: set[str] = set()
    written: set[str] = set()
    cache_arguments = _cache_arguments()
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in cache_arguments:
            continue
        arguments, in_place = cache_arguments[node.target]
        for index, role in arguments:
            source = node_argument(node, index)
            if source is None:  # an optional scale cache not given (float caches)
                continue
            _check_cache_argument(ep, node, source, role, in_place)
            if source.op == "placeholder":
                used.add(source.name)
                if in_place:
                    written.add(source.name)
    _check_foreign_mutations(ep, set(user_inputs))
    return CacheInputs(
        inputs=tuple(name for name in user_inputs if name in used),
        written=tuple(name for name in user_inputs if name in written),
    )


def _copy_program(ep: ExportedProgram) -> ExportedProgram:
    """A copy of ``ep`` with its own graph (weights are shared, not copied)."""
    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(ep.graph._codegen)
    output = graph.graph_copy(ep.graph, {})
    graph.output(output)
    module = torch.fx.GraphModule(ep.graph_module, graph)
    module.meta.update(ep.graph_module.meta)
    return program_over(ep, module, copy.deepcopy(ep.graph_signature))


def program_over(
    ep: ExportedProgram, module: torch.fx.GraphModule, signature: ExportGraphSignature
) -> ExportedProgram:
    """``ep`` with another graph module and signature (its weights, constants and shapes)."""
    kept = ("state_dict", "range_constraints", "module_call_graph", "example_inputs")
    kept += ("constants", "verifiers")
    return ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=signature,
        **{name: getattr(ep, name) for name in kept},
    )


def _fake_result(overload, arguments: list):
    """What ``overload`` returns on the recorded fake values of ``arguments`` (None where one
    has none): the twin's node metadata, which the translation reads for its output types."""
    values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in arguments]
    if any(
        isinstance(a, torch.fx.Node) and v is None for a, v in zip(arguments, values, strict=True)
    ):
        return None
    mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if mode is None:
        return None
    with mode:
        return overload(*values)


def functionalize_cache_writes(ep: ExportedProgram) -> tuple[ExportedProgram, int]:
    """A copy of ``ep`` where every in-place cache write (``reshape_and_cache``) is its
    functional twin (``reshape_and_cache_functional``) + ``aten.copy_`` of its outputs into the
    caches; returns it and the number of rewritten calls. ``ep`` itself is left unchanged."""
    ep = _copy_program(ep)
    graph = ep.graph
    twins = _functional_twins()
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in twins:
            continue
        functional, cache_indices = twins[node.target]
        arguments = [node_argument(node, i) for i in range(len(functional._schema.arguments))]
        with graph.inserting_before(node):
            written = graph.call_function(functional, tuple(arguments))
            written.meta.update(node.meta)
            written.meta["val"] = _fake_result(functional, arguments)
            caches = [arguments[i] for i in cache_indices if arguments[i] is not None]
            for index, cache in enumerate(caches):
                new_cache = graph.call_function(operator.getitem, (written, index))
                if "val" in cache.meta:
                    new_cache.meta["val"] = cache.meta["val"]
                graph.call_function(torch.ops.aten.copy_.default, (cache, new_cache))
        graph.erase_node(node)
        count += 1
    ep.graph_module.recompile()
    return ep, count
