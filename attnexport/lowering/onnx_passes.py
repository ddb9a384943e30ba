"""Passes on the ONNX graph (``onnx_ir``) that torch.onnx produced from the functionalized
program: cache outputs, output names, and the in-place check.

torch.onnx drops mutated inputs from the outputs (docs/traps.md). Here the written caches
come back by structure, not by name: each ``attnexport.ReshapeAndCache`` node's outputs are the
new values of its cache inputs, so the last write into graph input ``X`` becomes the graph
output ``X_out``. This runs on the unoptimized graph (nothing dead-code eliminated yet).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnx_ir as ir

from attnexport.custom_ops.onnx_spec import OnnxOp
from attnexport.lowering.registry import DOMAIN, onnx_ops
from attnexport.model_contract import PREFILL_ATTENTION

_PASSTHROUGH = ("Identity", "CastLike", "Cast")


def _spec(node: ir.Node) -> OnnxOp | None:
    return onnx_ops().get(node.op_type) if node.domain == DOMAIN else None


def is_write(node: ir.Node) -> bool:
    """A node whose outputs are the new values of its cache inputs (``ReshapeAndCache``)."""
    spec = _spec(node)
    return spec is not None and spec.writes_caches


def _same_type(a: ir.Value, b: ir.Value) -> bool:
    return a.dtype is not None and a.dtype == b.dtype


def _strip_passthrough(value: ir.Value) -> ir.Value:
    """Follows Identity and same-type casts (torch's ``aten.copy`` lowering) upstream."""
    while True:
        node = value.producer()
        if not is_standard(node, *_PASSTHROUGH):
            return value
        source = node.inputs[0]
        if source is None or not _same_type(source, value):
            return value
        value = source


def drop_absent_scale_outputs(model: ir.Model) -> int:
    """Rewrites each cache write without scale-cache inputs (float caches) that carries the
    scale-cache outputs anyway (the translation gets as many outputs as the schema declares)
    into one with the two cache outputs only, as its function body has; returns the count.

    Raises:
        ValueError: such an output has a user (it would be read, but nothing writes it).
    """
    count = 0
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        spec = _spec(node)
        if spec is None or spec.has_scales(list(node.inputs)):
            continue
        keep = [i for i, port in enumerate(spec.outputs) if not port.scale]
        if len(node.outputs) <= len(keep):
            continue
        extra = [v for i, v in enumerate(node.outputs) if i not in keep]
        if any(v.uses() or v.is_graph_output() for v in extra):
            raise ValueError(
                f"{node.op_type} node '{node.name}': its scale-cache outputs are read but it "
                f"has no scale-cache inputs"
            )
        trimmed = ir.Node(
            node.domain,
            node.op_type,
            node.inputs,
            attributes=list(node.attributes.values()),
            num_outputs=len(keep),
            name=node.name,
        )
        for i, output in zip(keep, trimmed.outputs, strict=True):
            output.name, output.type, output.shape = (
                node.outputs[i].name,
                node.outputs[i].type,
                node.outputs[i].shape,
            )
        ir.convenience.replace_nodes_and_values(
            node.graph, node, [node], [trimmed], [node.outputs[i] for i in keep], trimmed.outputs
        )
        count += 1
    return count


def connect_caches_directly(model: ir.Model) -> None:
    """Makes every cache read/write take its cache straight from the upstream value, skipping
    the no-op copies torch emits for ``aten.copy``, so that a write's data input is the graph
    input itself (required for the in-place update)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        spec = _spec(node)
        if spec is None:
            continue
        for index in spec.state_inputs:
            value = node.inputs[index] if index < len(node.inputs) else None
            if value is not None:
                node.replace_input_with(index, _strip_passthrough(value))


def expose_cache_writes(model: ir.Model, written: Sequence[str]) -> dict[str, str]:
    """Adds the final value of each written cache input ``X`` as graph output ``X_out``.

    Args:
        written: names of the graph inputs that the model writes (from the FX program).

    Returns:
        ``{cache input: cache output}`` in the order of ``written``.

    Raises:
        ValueError: a write targets something that is not a graph input (for instance an
            initializer: a cache captured as a constant), or a written input has no write.
    """
    graph = model.graph
    inputs = {value.name: value for value in graph.inputs}
    final: dict[str, ir.Value] = {}
    origin: dict[ir.Value, str] = {}  # a written cache value -> the graph input it updates
    for node in graph:  # topological order: later writes of a cache replace earlier ones
        if not is_write(node):
            continue
        # The caches it has (scale caches only with int8 caches), and their new values.
        args = node.inputs
        present = [i for i in _spec(node).state_inputs if i < len(args) and args[i] is not None]
        for index, new_value in zip(present, node.outputs, strict=True):
            cache = _strip_passthrough(node.inputs[index])
            if cache.name in inputs and inputs[cache.name] is cache:
                base = cache.name
            elif cache in origin:
                base = origin[cache]
            else:
                kind = "an initializer (a constant)" if cache.is_initializer() else "not an input"
                raise ValueError(
                    f"{node.op_type} node '{node.name}' writes '{cache.name}', which is {kind}; "
                    f"a written cache must be a graph input"
                )
            origin[new_value] = base
            final[base] = new_value
    missing = [name for name in written if name not in final]
    if missing:
        raise ValueError(f"written caches {missing} have no ReshapeAndCache node in the graph")
    outputs = {}
    for name in written:
        value = final[name]
        value.name = f"{name}_out"
        graph.outputs.append(value)
        outputs[name] = value.name
    return outputs


def name_outputs(model: ir.Model, cache_outputs: dict[str, str], names: Sequence[str] | None):
    """Names the user outputs (default: ``output`` or ``output_<i>``) and orders the graph
    outputs: user outputs first, then the cache outputs in cache input order."""
    graph = model.graph
    cache_names = set(cache_outputs.values())
    user = [v for v in graph.outputs if v.name not in cache_names]
    caches = {v.name: v for v in graph.outputs if v.name in cache_names}
    if names is None:
        names = ["output"] if len(user) == 1 else [f"output_{i}" for i in range(len(user))]
    if len(names) != len(user):
        raise ValueError(
            f"output_names: expected {len(user)} names (one per model output), got {list(names)}"
        )
    taken = {v.name for v in graph.inputs} | cache_names
    renamed = []
    for value, name in zip(user, names, strict=True):
        if name in taken:
            raise ValueError(f"output_names: '{name}' is already the name of a graph input/output")
        if value.is_graph_input() or value in caches.values():
            # An input or cache returned as is: the output needs a value of its own.
            copy = ir.Node("", "Identity", [value])
            graph.append(copy)
            value = copy.outputs[0]
        value.name = name
        taken.add(name)
        renamed.append(value)
    graph.outputs.clear()
    graph.outputs.extend([*renamed, *(caches[n] for n in cache_outputs.values())])


def check_cache_io(model: onnx.ModelProto, cache_inputs: Sequence[str], cache_outputs: dict):
    """Checks the final model: every cache is a graph input (not an initializer), every
    written cache has its ``_out`` output, produced by a node that takes the cache input itself
    (so that binding one buffer to both updates it in place).

    Raises:
        ValueError: naming the cache and what is wrong.
    """
    graph = model.graph
    inputs = {i.name for i in graph.input}
    initializers = {i.name for i in graph.initializer}
    outputs = {o.name for o in graph.output}
    producers = {name: node for node in graph.node for name in node.output}
    for name in cache_inputs:
        if name in initializers:
            raise ValueError(f"cache '{name}' was baked into the model as an initializer")
        if name not in inputs:
            raise ValueError(f"cache '{name}' is not a graph input")
    for name, out in cache_outputs.items():
        if out not in outputs:
            raise ValueError(f"written cache '{name}' is not exposed as graph output '{out}'")
        node = producers.get(out)
        if node is None or name not in node.input:
            producer = "a graph input" if node is None else f"{node.op_type} '{node.name}'"
            raise ValueError(
                f"cache output '{out}' comes from {producer}, which does not take '{name}' "
                f"directly: the update could not happen in place"
            )


def attribute_value(node: ir.Node, name: str, default):
    """The value of ``node``'s attribute ``name``, or ``default`` when it has none."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def is_standard(node: ir.Node | None, *op_types: str) -> bool:
    """``node`` is one of ``op_types`` of the standard ONNX domain."""
    return node is not None and node.op_type in op_types and node.domain in ("", "ai.onnx")


def standard_nodes(graph: ir.Graph, op_type: str) -> list[ir.Node]:
    """The standard-domain ``op_type`` nodes of ``graph``, as a list (a pass may rewrite the
    graph while it goes through them)."""
    return [node for node in graph if is_standard(node, op_type)]


def is_constant_matrix(value: ir.Value | None) -> bool:
    """``value`` is a 2-D initializer with its data (a weight a pass may rewrite)."""
    return (
        value is not None
        and value.is_initializer()
        and value.const_value is not None
        and len(value.const_value.shape) == 2
    )


def gemm_to_matmul(model: ir.Model) -> int:
    """Rewrites ``Gemm(x, W, b?, transB)`` with a constant 2-D ``W`` (torch.onnx's lowering of
    ``nn.Linear``) into ``MatMul(x, W')`` (+ ``Add(b)``), ``W'`` the constant weight in
    ``[in, out]`` layout (``W`` transposed once, here, when ``transB=1``).

    This is the form onnxruntime's weight quantizer (``MatMulNBitsQuantizer``) rewrites into
    ``MatMulNBits``; it does not touch ``Gemm``. Only ``alpha = beta = 1``, ``transA = 0``
    nodes are rewritten (what ``nn.Linear`` gives); any other Gemm is left as it is, and so is
    the Gemm on a weight that other nodes also read (a tied ``lm_head`` / embedding): a
    transposed copy would store the table twice, and MLAS runs ``transB`` as fast (the weight
    quantization rewrites that node itself, :mod:`attnexport.lowering.lm_head`).

    Returns:
        The number of Gemm nodes rewritten.
    """
    graph = model.graph
    rewritten = 0
    for node in standard_nodes(graph, "Gemm"):
        weight = node.inputs[1]
        if (
            attribute_value(node, "alpha", 1.0) != 1.0
            or attribute_value(node, "beta", 1.0) != 1.0
            or attribute_value(node, "transA", 0) != 0
            or not is_constant_matrix(weight)
            or (attribute_value(node, "transB", 0) and len(weight.uses()) > 1)
        ):
            continue
        matrix = _transposed(graph, weight) if attribute_value(node, "transB", 0) else weight
        matmul = ir.Node("", "MatMul", [node.inputs[0], matrix], name=node.name)
        nodes = [matmul]
        result = matmul.outputs[0]
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        if bias is not None:
            add = ir.Node("", "Add", [result, bias], name=f"{node.name}_bias")
            nodes.append(add)
            result = add.outputs[0]
        output = node.outputs[0]
        name = output.name
        result.type, result.shape = output.type, output.shape
        matmul.outputs[0].type = output.type
        graph.insert_before(node, nodes)
        ir.convenience.replace_all_uses_with(output, result, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        result.name = name
        if not weight.uses() and weight.is_initializer() and not weight.is_graph_input():
            graph.initializers.pop(weight.name)
        rewritten += 1
    return rewritten


def _transposed(graph: ir.Graph, weight: ir.Value) -> ir.Value:
    """A new initializer ``<weight>.T``: the constant 2-D ``weight`` transposed, computed
    when it is read (at save, one weight at a time: the lowering never holds a transposed copy
    of every weight beside the originals)."""
    source = weight.const_value
    rows, columns = source.shape
    name = f"{weight.name}.T"
    matrix = ir.Value(
        name=name,
        shape=ir.Shape((columns, rows)),
        type=weight.type,
        const_value=ir.LazyTensor(
            lambda: ir.tensor(np.ascontiguousarray(source.numpy().T), name=name),
            dtype=source.dtype,
            shape=ir.Shape((columns, rows)),
            name=name,
        ),
    )
    graph.register_initializer(matrix)
    return matrix


def transpose_weights(model: ir.Model) -> int:
    """Replaces each ``Transpose(W)`` of a constant 2-D initializer ``W`` (torch.onnx's lowering
    of ``nn.Linear`` on 3-D inputs: ``MatMul(x, Transpose(W))``) by the initializer
    ``<W>.T``, so that the weight keeps its module's name (``model.layers.0.mlp.down_proj``
    for the quantizer's layer names and the fusions') where the optimizer's constant folding
    would name it ``val_N``.

    A ``W`` that other nodes read too (a tied embedding, ``Gather(W)`` beside
    ``MatMul(x, Transpose(W))``) is not copied: the table would be stored twice. Each
    ``MatMul`` on it becomes ``Gemm(x, W, transB=1)`` instead (the zoo's form,
    which the weight quantization rewrites, :mod:`attnexport.lowering.lm_head`); the Transpose
    stays only for other readers. Returns the number of Transpose nodes replaced."""
    graph = model.graph
    replaced = 0
    for node in standard_nodes(graph, "Transpose"):
        weight = node.inputs[0]
        if (
            not is_constant_matrix(weight)
            or tuple(attribute_value(node, "perm", (1, 0))) != (1, 0)
            or node.outputs[0].is_graph_output()
        ):
            continue
        if len(weight.uses()) > 1:
            replaced += _gemm_on_tied_weight(graph, node)
            continue
        matrix = _transposed(graph, weight)
        ir.convenience.replace_all_uses_with(node.outputs[0], matrix)
        graph.remove(node, safe=True)
        if not weight.uses() and not weight.is_graph_input():
            graph.initializers.pop(weight.name)
        replaced += 1
    return replaced


def _gemm_on_tied_weight(graph: ir.Graph, transpose: ir.Node) -> int:
    """Rewrites each ``MatMul(x, Transpose(W))`` into ``Gemm(x, W, transB=1)`` (an ``x`` of
    rank > 2 flattened to ``[-1, K]`` around it and its result reshaped back; same output
    value name); removes the Transpose when nothing else reads it. Returns 1 when it was
    removed."""
    weight, transposed = transpose.inputs[0], transpose.outputs[0]
    columns, rows = weight.shape  # W is [N, K]
    for user, index in list(transposed.uses()):
        x = user.inputs[0]
        if (
            user.op_type != "MatMul"
            or user.domain not in ("", "ai.onnx")
            or index != 1
            or x is None
            or x.shape is None
            or len(x.shape) < 2
        ):
            continue
        nodes = []
        flat = x
        if len(x.shape) > 2:
            nodes.append(_int64_constant(f"{user.name}_flat_shape", [-1, rows]))
            nodes.append(ir.Node("", "Reshape", [x, nodes[-1].outputs[0]]))
            flat = nodes[-1].outputs[0]
        gemm = ir.Node("", "Gemm", [flat, weight], [ir.AttrInt64("transB", 1)], name=user.name)
        nodes.append(gemm)
        result = gemm.outputs[0]
        output = user.outputs[0]
        if len(x.shape) > 2:
            lead = ir.Node("", "Shape", [x], [ir.AttrInt64("end", -1)])
            width = _int64_constant(f"{user.name}_width", [columns])
            shape = ir.Node(
                "", "Concat", [lead.outputs[0], width.outputs[0]], [ir.AttrInt64("axis", 0)]
            )
            back = ir.Node("", "Reshape", [result, shape.outputs[0]])
            nodes += [lead, width, shape, back]
            result = back.outputs[0]
        name = output.name
        result.type, result.shape = output.type, output.shape
        graph.insert_before(user, nodes)
        ir.convenience.replace_all_uses_with(output, result, replace_graph_outputs=True)
        graph.remove(user, safe=True)
        result.name = name
    if transposed.uses():
        return 0
    graph.remove(transpose, safe=True)
    return 1


def _int64_constant(name: str, values: list[int]) -> ir.Node:
    return ir.Node(
        "",
        "Constant",
        [],
        [ir.AttrTensor("value", ir.tensor(np.array(values, dtype=np.int64), name=name))],
    )


def set_prefill_attention(model: ir.Model, precision: str) -> int:
    """Marks every attnexport PagedAttention node of ``model`` with ``prefill_bf16 = 1`` when
    ``precision`` is ``"bfloat16"`` (the native kernel's prefills in bfloat16 pairs where the
    CPU has AVX512_BF16: docs/lowering.md); returns the nodes marked."""
    if precision not in PREFILL_ATTENTION:
        raise ValueError(
            f"prefill_attention: expected one of {', '.join(PREFILL_ATTENTION)}, got {precision!r}"
        )
    if precision == "float32":
        return 0
    marked = 0
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == DOMAIN and node.op_type == "PagedAttention":
            node.attributes["prefill_bf16"] = ir.AttrInt64("prefill_bf16", 1)
            marked += 1
    return marked
