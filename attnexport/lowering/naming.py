"""Readable names for the exported graph: dynamic dimensions and user outputs.

Graph inputs keep the names torch.export gives the forward's arguments: a tensor argument
``key_cache`` is the input ``key_cache``; a list argument ``kv_caches`` becomes
``kv_caches_0``, ``kv_caches_1``, ... (a dict argument ``d`` becomes ``d_<key>``). Each cache
input ``X`` that the model writes gets the output ``X_out``.

Dynamic dimensions (``s37`` in torch's numbering) are named, in order of preference, by
the ``Dim`` objects the caller passed, by the role of the input in an attnexport op
(``block_tables`` -> ``num_seqs, max_blocks_per_seq``; a cache -> ``num_blocks, ...``), by the
model-interface input names (``input_ids`` -> ``num_tokens``), and else ``<input>_dim<i>``.
Expressions keep their form with the names substituted (``num_seqs + 1``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping

import onnx_ir as ir
import torch
from torch.export import ExportedProgram

from attnexport.custom_ops.onnx_spec import TOKENS
from attnexport.lowering.passes import node_argument, torch_argument_index
from attnexport.lowering.registry import torch_op_specs

_SEQS = ("num_seqs",)
# The decoder forward of attnexport.model_interface (and common encoder inputs), by name.
_NAME_DIMS = {
    "input_ids": (TOKENS,),
    "hidden": (TOKENS,),
    "hidden_states": (TOKENS,),
    "positions": (TOKENS,),
    "slot_mapping": (TOKENS,),
    "block_tables": (*_SEQS, "max_blocks_per_seq"),
    "seq_lens": _SEQS,
    "query_start_loc": ("num_seqs_plus_1",),
    "cu_seqlens": ("num_seqs_plus_1",),
    "logits_indices": ("num_logits",),
}

BATCH_DIM_NAMES = frozenset(
    {TOKENS, "num_key_tokens", "num_seqs", "num_seqs_plus_1", "num_blocks", "max_blocks_per_seq"}
)
"""Dimensions that change from step to step and must stay dynamic."""

_SYMBOL = re.compile(r"\b[su]\d+\b")


def input_dim_names(ep: ExportedProgram) -> dict[str, tuple[str, ...]]:
    """``{input name: names of its dims}`` from the roles of the inputs (see module doc): the
    dimension names of the op input an input feeds (the slices' ``Port.dims``), else of its
    name."""
    ops = torch.ops.attnexport
    op_dims = {}
    for name, (spec, _) in torch_op_specs().items():
        overload = getattr(ops, name).default
        op_dims[overload] = {
            torch_argument_index(overload, spec.inputs[i].name, i): dims
            for i, dims in spec.input_dims().items()
        }
    names: dict[str, tuple[str, ...]] = {}
    for node in ep.graph.nodes:
        if node.op != "call_function" or node.target not in op_dims:
            continue
        for index, dims in op_dims[node.target].items():
            source = node_argument(node, index)
            if isinstance(source, torch.fx.Node) and source.op == "placeholder":
                names.setdefault(source.name, dims)
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in _NAME_DIMS:
            names.setdefault(node.name, _NAME_DIMS[node.name])
    return names


def _flat_leaves(value, spec, path: str) -> Iterator[tuple[str, object]]:
    """(flattened input name, per-tensor dynamic-shape spec) for every tensor in ``value``."""
    if isinstance(value, torch.Tensor):
        yield path, spec
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flat_leaves(item, _child(spec, i), f"{path}_{i}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _flat_leaves(item, _child(spec, key), f"{path}_{key}")


def _child(spec, key):
    if spec is None:
        return None
    try:
        return spec[key]
    except (KeyError, IndexError, TypeError):
        return None


def bound_arguments(module: torch.nn.Module, args: tuple, kwargs: Mapping | None) -> dict:
    """``{parameter name: value}`` of a forward call, in signature order."""
    bound = inspect.signature(module.forward).bind(*args, **(kwargs or {}))
    return dict(bound.arguments)


def user_dim_names(
    module: torch.nn.Module, args: tuple, kwargs: Mapping | None, dynamic_shapes
) -> dict[tuple[str, int], str]:
    """``{(input name, dim): name}`` for every named ``Dim`` in ``dynamic_shapes``."""
    if dynamic_shapes is None:
        return {}
    arguments = bound_arguments(module, args, kwargs)
    if isinstance(dynamic_shapes, Mapping):
        specs = dynamic_shapes
    else:
        specs = dict(zip(arguments, dynamic_shapes, strict=False))
    names: dict[tuple[str, int], str] = {}
    for parameter, value in arguments.items():
        for input_name, spec in _flat_leaves(value, specs.get(parameter), parameter):
            items = spec.items() if isinstance(spec, Mapping) else enumerate(spec or ())
            for dim, dim_spec in items:
                name = getattr(dim_spec, "__name__", None)
                if isinstance(name, str) and name.isidentifier():
                    names[(input_name, int(dim))] = name
    return names


def auto_dynamic_shapes(module: torch.nn.Module, args: tuple, kwargs: Mapping | None) -> dict:
    """``Dim.AUTO`` (dynamic unless the model fixes it, relations inferred by torch.export) on
    the first dimension of every tensor argument and on every dimension of integer tensors
    (block tables vary in both); the other dimensions of floating-point tensors (heads, head
    size, block size, hidden size) stay static."""

    def spec(value):
        if isinstance(value, torch.Tensor):
            dynamic = range(value.dim()) if not value.is_floating_point() else range(1)
            return {i: torch.export.Dim.AUTO for i in dynamic if i < value.dim()}
        if isinstance(value, (list, tuple)):
            return type(value)(spec(v) for v in value)
        if isinstance(value, Mapping):
            return {k: spec(v) for k, v in value.items()}
        return None

    return {name: spec(value) for name, value in bound_arguments(module, args, kwargs).items()}


# --------------------------------------------------------------------------- ONNX side


def _all_values(graph: ir.Graph) -> Iterator[ir.Value]:
    yield from graph.inputs
    for node in ir.traversal.RecursiveGraphIterator(graph):
        yield from node.outputs


def rename_dims(
    model: ir.Model,
    role_names: Mapping[str, tuple[str, ...]],
    user_names: Mapping[tuple[str, int], str],
) -> dict[str, str]:
    """Renames torch's dimension symbols in every shape of ``model``; returns
    ``{symbol: name}``."""
    symbols: dict[str, str] = {}
    taken: set[str] = set()

    def claim(symbol: str, wanted: str) -> None:
        name, suffix = wanted, 2
        while name in taken:
            name, suffix = f"{wanted}_{suffix}", suffix + 1
        taken.add(name)
        symbols[symbol] = name

    # Two passes: names from Dims and roles first, so that a fallback name (<input>_dim<i>)
    # never takes a symbol that a later input knows a better name for.
    fallbacks: list[tuple[str, str]] = []
    for value in model.graph.inputs:
        for index, dim in enumerate(value.shape or ()):
            if not isinstance(dim, ir.SymbolicDim) or dim.value is None:
                continue
            if not _SYMBOL.fullmatch(dim.value) or dim.value in symbols:
                continue
            roles = role_names.get(value.name, ())
            wanted = user_names.get((value.name, index)) or (
                roles[index] if index < len(roles) else None
            )
            if wanted:
                claim(dim.value, wanted)
            else:
                fallbacks.append((dim.value, f"{value.name}_dim{index}"))
    for symbol, wanted in fallbacks:
        if symbol not in symbols:
            claim(symbol, wanted)

    def rename(dim):
        if isinstance(dim, ir.SymbolicDim) and dim.value is not None:
            renamed = _SYMBOL.sub(lambda m: symbols.get(m.group(0), m.group(0)), dim.value)
            return ir.SymbolicDim(renamed)
        return dim

    for value in _all_values(model.graph):
        if value.shape is not None:
            value.shape = ir.Shape([rename(d) for d in value.shape])
    return symbols


def static_batch_dims(ep: ExportedProgram) -> list[str]:
    """Descriptions of step-varying dimensions (tokens, sequences, blocks) that torch.export
    fixed to a number, e.g. because the sample had size 0 or 1 there."""
    problems = []
    names = input_dim_names(ep)
    for node in ep.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        shape = getattr(node.meta.get("val"), "shape", ())
        for index, (size, name) in enumerate(zip(shape, names[node.name], strict=False)):
            if name in BATCH_DIM_NAMES and isinstance(size, int):
                problems.append(f"{node.name} dimension {index} ({name}) = {size}")
    return problems
