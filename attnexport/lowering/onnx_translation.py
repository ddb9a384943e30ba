"""torch.onnx's translation of a program on the attnexport ops, without its decomposition retrace.

``torch.onnx.export(program)`` first runs ``program.run_decompositions``: a full re-trace of the
graph under fake tensors that functionalizes it and decomposes the ops torch.onnx has no
translation for. On SmolLM2-135M (30 layers) that retrace was ~3 s of the translation's ~4 s,
and the programs of our models need neither step: after
:func:`~attnexport.lowering.passes.functionalize_cache_writes` their only in-place ops are the
``aten.copy_`` of the written caches back into their inputs, and torch.onnx translates every
other op they call as it is. So when every op of a program has a translation (nothing to
decompose), :func:`translate` makes it functional by hand (each cache ``copy_`` becomes an
input-mutation output and later reads of that cache read the written value, as functionalization
would) and hands it straight to the translation; any other program takes torch.onnx's own path.

The hook is torch.onnx's private ``_prepare_exported_program_for_export`` (torch 2.8-2.13), swapped
for the duration of one export under a lock; a torch without it exports the usual way.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import threading
from collections.abc import Callable, Iterator, Mapping

import onnx_ir as ir
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from attnexport.lowering.export import without_stack_traces
from attnexport.lowering.passes import program_over
from attnexport.lowering.quiet import quieted

logger = logging.getLogger(__name__)

_aten = torch.ops.aten
_IDENTITIES = frozenset({_aten.detach.default, _aten.detach_.default, _aten.alias.default})
"""Ops that return their input (or mark it): value semantics make them the input itself."""
_ASSERTIONS = frozenset(
    {
        _aten._assert_tensor_metadata.default,
        _aten._assert_async.default,
        _aten._assert_async.msg,
        _aten._assert_scalar.default,
        _aten.sym_constrain_range_for_size.default,
    }
)
"""Checks torch.onnx drops after its retrace (``remove_assertion_nodes``)."""


def _same_arguments(op):
    return lambda args: (op, args, {})


def _cast(dtype_index: int):
    """``aten.to`` (the device is the graph's own: ONNX has none) -> ``aten._to_copy``."""
    return lambda args: (_aten._to_copy.default, args[:1], {"dtype": args[dtype_index]})


_REWRITES = {
    _aten.to.dtype: (2, _cast(1)),
    _aten.to.device: (3, _cast(2)),
    _aten.__and__.Tensor: (2, _same_arguments(_aten.bitwise_and.Tensor)),
    _aten.__or__.Tensor: (2, _same_arguments(_aten.bitwise_or.Tensor)),
    _aten.min.other: (2, _same_arguments(_aten.minimum.default)),
    _aten.max.other: (2, _same_arguments(_aten.maximum.default)),
    _aten.square.default: (1, lambda args: (_aten.pow.Tensor_Scalar, (args[0], 2), {})),
}
"""Ops the retrace would decompose (they have no translation of their own) -> (how many
positional arguments the rewrite takes, the op with the arguments their decomposition calls):
``aten.to`` and the operators translate as what they decompose into."""

_hook_lock = threading.Lock()


def _written_caches(program: ExportedProgram) -> set[str]:
    """Names of the user-input placeholders that an ``aten.copy_`` writes into."""
    user_inputs = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.USER_INPUT and isinstance(spec.arg, TensorArgument)
    }
    return {
        node.args[0].name
        for node in program.graph.find_nodes(op="call_function", target=_aten.copy_.default)
        if node.args[0].op == "placeholder" and node.args[0].name in user_inputs
    }


def _reads_or_writes_caches(node: torch.fx.Node) -> bool:
    target = node.target
    ours = isinstance(target, torch._ops.OpOverload) and target.namespace == "attnexport"
    return ours or target == _aten.copy_.default


def direct_blockers(program: ExportedProgram, is_registered: Callable[[object], bool]) -> list[str]:
    """Why ``program`` needs torch.onnx's decomposition retrace (empty: it does not).

    Args:
        program: the functionalized program (cache writes as twin + ``aten.copy_``).
        is_registered: whether torch.onnx translates an op (its registry's ``is_registered``).
    """
    written = _written_caches(program)
    blockers = []
    for node in program.graph.nodes:
        if node.op == "get_attr" and isinstance(
            getattr(program.graph_module, node.target, None), torch.fx.GraphModule
        ):
            blockers.append(f"subgraph {node.target}")
        if node.op == "placeholder" and node.name in written:
            foreign = [user for user in node.users if not _reads_or_writes_caches(user)]
            if foreign:
                blockers.append(f"cache {node.name} read by {foreign[0].target}")
        if node.op != "call_function":
            continue
        target = node.target
        if target is operator.getitem or target in _IDENTITIES or target in _ASSERTIONS:
            continue
        if target in _REWRITES:
            if len(node.args) > _REWRITES[target][0] or node.kwargs:
                blockers.append(f"{target} with options {node.args[1:]} {node.kwargs}")
                continue
            target = _REWRITES[target][1](node.args)[0]
        if target == _aten.copy_.default:
            destination = node.args[0]
            if destination.op != "placeholder" or destination.name not in written or node.users:
                blockers.append(f"{target} into {destination.name}")
            continue
        if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
            blockers.append(f"in-place {target}")
        elif not is_registered(target):
            blockers.append(f"{target} (no translation)")
    return blockers


def functional_program(program: ExportedProgram) -> ExportedProgram:
    """``program`` (modified in place and returned as a new ExportedProgram over its graph) made
    functional without a retrace: identities and checks dropped, the ops of ``_REWRITES`` as
    what they decompose into, each cache ``copy_`` removed, the reads after it given the written
    value and the last written value of each cache an input-mutation output (as
    ``run_decompositions`` leaves it). Only for programs :func:`direct_blockers` passes."""
    graph = program.graph
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # cache placeholder -> its written value
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        for source in node.all_input_nodes:
            if source in latest:
                node.replace_input_with(source, latest[source])
        target = node.target
        if target in _IDENTITIES:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif target in _ASSERTIONS:
            graph.erase_node(node)
        elif target in _REWRITES:
            node.target, node.args, node.kwargs = _REWRITES[target][1](node.args)
        elif target == _aten.copy_.default:
            latest[node.args[0]] = node.args[1]
            graph.erase_node(node)
    output = graph.output_node()
    mutations = [
        (cache.name, value)
        for cache in graph.find_nodes(op="placeholder")
        for value in [latest.get(cache)]
        if value is not None
    ]
    output.args = (tuple(value for _, value in mutations) + tuple(output.args[0]),)
    signature = program.graph_signature
    output_specs = [
        OutputSpec(OutputKind.USER_INPUT_MUTATION, TensorArgument(value.name), name)
        for name, value in mutations
    ]
    program.graph_module.recompile()
    return program_over(
        program,
        program.graph_module,
        ExportGraphSignature(
            input_specs=list(signature.input_specs),
            output_specs=[*output_specs, *signature.output_specs],
        ),
    )


def _promotes(value, dtype: torch.dtype | None) -> bool:
    """Whether torch.onnx's type promotion would cast argument ``value`` (its recorded value for
    a node) to ``dtype``: a tensor of another dtype, a number or symbol of another kind."""
    if dtype is None:
        return False
    if isinstance(value, (list, tuple)):
        return any(_promotes(item, dtype) for item in value)
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    if isinstance(value, torch.Tensor):
        return value.dtype != dtype
    from torch.onnx._internal.fx import type_utils

    scalar = type_utils.from_scalar_type_to_torch_dtype(type(value))
    return scalar is not None and scalar != dtype


def needs_type_promotion(module: torch.fx.GraphModule) -> bool:
    """Whether torch.onnx's ``insert_type_promotion_nodes`` would change ``module``: the same
    rules and test of each argument, read from the recorded values instead of re-running every
    node under fake tensors (the pass took 1.1 s of the transformers path's SmolLM2 export and
    changed nothing). Any doubt (a node without recorded values) answers True."""
    from torch.onnx._internal.fx.passes import type_promotion

    table = type_promotion.TypePromotionTable()
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        rule = type_promotion.get_type_promotion_rule(node, table)
        if rule is None:
            continue
        if any(n.meta.get("val") is None for n in node.all_input_nodes):
            return True
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta["val"])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: n.meta["val"])
        promotion = rule.preview_type_promotion(tuple(args), dict(kwargs))
        if any(
            _promotes(arg, promotion.args_dtypes.get(i)) for i, arg in enumerate(node.args)
        ) or any(_promotes(arg, promotion.kwargs_dtypes.get(k)) for k, arg in node.kwargs.items()):
            return True
    return False


@contextlib.contextmanager
def _direct_preparation(used: list[bool]) -> Iterator[None]:
    """Swaps torch.onnx's program preparation for one that skips the retrace where
    :func:`direct_blockers` allows; ``used`` gets whether it did."""
    try:
        from torch.onnx._internal.exporter import _core, _fx_passes
        from torch.onnx._internal.fx import type_utils  # noqa: F401 (read by _promotes)
        from torch.onnx._internal.fx.passes import type_promotion  # noqa: F401
    except ImportError:  # a torch without the exporter's layout: the usual path
        yield
        return
    original = getattr(_core, "_prepare_exported_program_for_export", None)
    if original is None or not hasattr(_fx_passes, "insert_type_promotion_nodes"):
        yield
        return

    def prepare(exported_program: ExportedProgram, *, registry) -> ExportedProgram:
        blockers = direct_blockers(exported_program, registry.is_registered)
        if blockers:
            logger.info("torch.onnx's decomposition retrace runs: %s", "; ".join(blockers[:5]))
            return original(exported_program, registry=registry)
        used.append(True)
        prepared = functional_program(exported_program)
        if needs_type_promotion(prepared.graph_module):
            _fx_passes.insert_type_promotion_nodes(prepared.graph_module)
        return prepared

    with _hook_lock:
        _core._prepare_exported_program_for_export = prepare
        try:
            yield
        finally:
            _core._prepare_exported_program_for_export = original


def translate(
    program: ExportedProgram, translations: Mapping[Callable, Callable], opset_version: int
) -> tuple[ir.Model, bool]:
    """torch.onnx's ONNX model of the functionalized ``program`` (``optimize=False``, the
    attnexport ``translations``); returns it and whether the retrace was skipped."""
    used: list[bool] = []
    table = dict(translations)
    # torch.onnx's registry warns about every torchvision op it cannot find.
    with (
        quieted("torch.onnx._internal.exporter._registration", logging.ERROR),
        without_stack_traces(),
        _direct_preparation(used),
    ):
        options = {"dynamo": True, "optimize": False, "verbose": False}
        onnx_program = torch.onnx.export(
            program, (), opset_version=opset_version, custom_translation_table=table, **options
        )
    return onnx_program.model, bool(used)
