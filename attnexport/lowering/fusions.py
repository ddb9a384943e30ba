"""Rewrite rules that turn the standard-op patterns of transformers' modeling code (the
transformers path, ``attnexport.models.generic``) into attnexport's fused nodes, so that such a
graph runs the native kernels the zoo's models call directly:

====================  ===================================================================
rule                  what it rewrites
====================  ===================================================================
``sibling_matmuls``   ``MatMul(x, W_i)`` (+ ``Add(b_i)``) of one input and constant weights
                      -> one ``MatMul`` on the weights concatenated, then a ``Split`` (the
                      q/k/v and gate/up projections, fused as the zoo's are)
``rotary``            ``x * cos + rotate_half(x) * sin`` on ``[1, H, T, D]`` heads ->
                      ``attnexport.NeoxRotaryEmbedding`` on ``[T, H, D]``
``qkv_rotary``        the ``Split`` of a fused q/k/v projection into heads, the rotation of
                      q and k -> ``attnexport.NeoxQKVRotaryEmbedding``
``silu_and_mul``      ``silu(gate) * up`` of the halves of a fused projection ->
                      ``attnexport.SiluAndMul``
``add_rms_norm``      a residual ``Add`` and transformers' RMSNorm of the sum ->
                      ``attnexport.FusedAddRMSNorm``
``rms_norm``          transformers' RMSNorm (``x * Reciprocal(Sqrt(...))``) alone -> the
                      ``x / Sqrt(...)`` form onnxruntime fuses into one node
====================  ===================================================================

Between them the layout rules fold what the rewrites leave behind (inverse ``Transpose``
pairs, ``Reshape`` chains, ``Reshape`` to the shape a tensor already has). Each rule is an
onnxscript pattern with a check that names why a candidate does not fit (the numerics must be
those of the node: RMSNorm over the last axis in float32, the rotate-half halves, ...), and
:func:`fuse` returns how often each fired, which the graph contract records (``fusions``) and
``attnexport inspect`` reports. A zoo model's graph, already written on the fused ops, matches
nothing.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import common as common_passes
from onnxscript.rewriter import pattern
from onnxscript.rewriter.rules.common import _basic_rules

from attnexport.lowering.onnx_passes import is_constant_matrix, is_standard, standard_nodes
from attnexport.lowering.registry import DOMAIN
from attnexport.lowering.rule_matching import anchored_rule

_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
_INT64_MAX = 2**63 - 1


# ----------------------------------------------------------------------------- helpers


def _ints(value: ir.Value | None) -> list[int] | None:
    """The constant integer tensor ``value`` as a list (None when not constant)."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None:
        return None
    return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]


def _scalar(value: ir.Value | None) -> float | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return float(np.asarray(tensor.numpy()).reshape(-1)[0])


def _dims(value: ir.Value) -> tuple | None:
    return None if value.shape is None else tuple(value.shape.dims)


def _static(dim) -> int | None:
    return dim if isinstance(dim, int) else None


def _constant(op, values: list[int]) -> ir.Value:
    return op.Constant(value=ir.tensor(np.array(values, dtype=np.int64)))


def _typed(value: ir.Value, like: ir.Value, dims: list) -> ir.Value:
    value.type = like.type
    value.shape = ir.Shape(dims)
    return value


def _custom(op, name: str, *inputs, outputs: int = 1, **attributes):
    return getattr(op, name)(*inputs, _domain=DOMAIN, _outputs=outputs, **attributes)


# ----------------------------------------------------------------------------- matmuls


def _bias(matmul: ir.Node) -> tuple[ir.Node | None, np.ndarray | None]:
    """The ``Add`` of a constant ``[N]`` bias that is the only user of the MatMul's output."""
    uses = list(matmul.outputs[0].uses())
    if len(uses) != 1 or matmul.outputs[0].is_graph_output():
        return None, None
    add = uses[0].node
    if not is_standard(add, "Add"):
        return None, None
    other = add.inputs[1] if add.inputs[0] is matmul.outputs[0] else add.inputs[0]
    tensor = ir.convenience.get_const_tensor(other) if other is not None else None
    columns = matmul.inputs[1].const_value.shape[1]
    if tensor is None or tuple(tensor.shape) != (columns,):
        return None, None
    return add, np.asarray(tensor.numpy())


def fuse_sibling_matmuls(model: ir.Model) -> int:
    """Groups the ``MatMul(x, W_i)`` nodes of one input ``x`` whose weights are constant 2-D
    ``[K, N_i]`` of one dtype into one ``MatMul`` on ``concat(W_i, axis=1)`` and a ``Split``
    (with their constant ``[N_i]`` bias ``Add`` nodes, when every one of them has one); returns
    the number of groups. The fused weight is named after the first weight's module with the
    others' last parts joined (``model.layers.0.self_attn.q_proj+k_proj+v_proj.weight``)."""
    graph = model.graph
    groups: dict[int, list[ir.Node]] = {}
    for node in standard_nodes(graph, "MatMul"):
        weight = node.inputs[1]
        if not is_constant_matrix(weight) or node.inputs[0] is None:
            continue
        groups.setdefault(id(node.inputs[0]), []).append(node)
    fused = 0
    for nodes in groups.values():
        shapes = {(n.inputs[1].const_value.shape[0], n.inputs[1].const_value.dtype) for n in nodes}
        if len(nodes) < 2 or len(shapes) != 1:
            continue
        biases = [_bias(n) for n in nodes]
        with_bias = all(b[0] is not None for b in biases)
        _fuse_group(graph, nodes, biases if with_bias else None)
        fused += 1
    return fused


def _fused_name(names: list[str]) -> str:
    first = names[0].removesuffix(".T").removesuffix(".weight")
    prefix, _, _ = first.rpartition(".")
    rest = [n.removesuffix(".T").removesuffix(".weight").rpartition(".")[2] for n in names[1:]]
    return f"{first}+{'+'.join(rest)}.weight" if prefix else f"{'+'.join(names)}"


def _fuse_group(graph: ir.Graph, nodes: list[ir.Node], biases) -> None:
    weights = [n.inputs[1] for n in nodes]
    columns = [w.const_value.shape[1] for w in weights]
    name = _fused_name([w.name or "weight" for w in weights])
    sources = [w.const_value for w in weights]
    shape = ir.Shape((sources[0].shape[0], sum(columns)))
    # computed when the file is written, one fused weight at a time: concatenated here, every
    # q/k/v and gate/up projection would be held twice until the save (the torch weights, or
    # their lazy transposes, beside the fused copies: 1.3x the weights on SmolLM2)
    matrix = ir.Value(
        name=name,
        shape=shape,
        type=weights[0].type,
        const_value=ir.LazyTensor(
            lambda: ir.tensor(np.concatenate([t.numpy() for t in sources], axis=1), name=name),
            dtype=sources[0].dtype,
            shape=shape,
            name=name,
        ),
    )
    graph.register_initializer(matrix)
    first = nodes[0]
    matmul = ir.Node("", "MatMul", [first.inputs[0], matrix], name=f"{name}/MatMul")
    new_nodes = [matmul]
    result = matmul.outputs[0]
    results = [n.outputs[0] for n in nodes]
    if biases is not None:
        vector = np.concatenate([b[1] for b in biases])
        bias = ir.Value(
            name=name.removesuffix(".weight") + ".bias",
            shape=ir.Shape(vector.shape),
            type=biases[0][0].outputs[0].type,
            const_value=ir.tensor(vector, name=name.removesuffix(".weight") + ".bias"),
        )
        graph.register_initializer(bias)
        add = ir.Node("", "Add", [result, bias], name=f"{name}/Add")
        new_nodes.append(add)
        result = add.outputs[0]
        results = [b[0].outputs[0] for b in biases]
    sizes = ir.Value(
        name=f"{name}/split",
        shape=ir.Shape([len(columns)]),
        type=ir.TensorType(ir.DataType.INT64),
        const_value=ir.tensor(np.array(columns, dtype=np.int64), name=f"{name}/split"),
    )
    graph.register_initializer(sizes)
    split = ir.Node(
        "",
        "Split",
        [result, sizes],
        attributes=[ir.AttrInt64("axis", -1)],
        num_outputs=len(columns),
        name=f"{name}/Split",
    )
    new_nodes.append(split)
    dims = list(first.outputs[0].shape.dims) if first.outputs[0].shape is not None else None
    if dims is not None:
        result.shape = ir.Shape([*dims[:-1], int(sum(columns))])
        matmul.outputs[0].shape = result.shape
    result.type = matmul.outputs[0].type = results[0].type
    # Before the first of the old nodes: the fused ones read only x and constants, and every
    # user of an old output comes after it.
    graph.insert_before(_first_of(graph, nodes), new_nodes)
    for old, new in zip(results, split.outputs, strict=True):
        new.type, new.shape = old.type, old.shape
        ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    graph.remove([*(b[0] for b in biases or ()), *nodes], safe=True)
    for weight in weights:
        if not weight.uses() and weight.is_initializer() and not weight.is_graph_input():
            graph.initializers.pop(weight.name)


def _first_of(graph: ir.Graph, nodes: list[ir.Node]) -> ir.Node:
    members = {id(n) for n in nodes}
    return next(node for node in graph if id(node) in members)


# ----------------------------------------------------------------------------- rotary


class RotaryEmbedding(pattern.RewriteRuleClassBase):
    """``x * cos + concat(-x2, x1) * sin`` (x1, x2 the halves of the head dim of x
    ``[1, H, T, D]``; cos, sin ``[1, 1, T, D]``) -> ``NeoxRotaryEmbedding`` on the heads as
    ``[T, H, D]``, transposed back: the layout rules fold the transposes into the producer's and
    the consumer's."""

    def pattern(self, op, x, cos, sin, start1, end1, axes1, start2, end2, axes2):
        first = op.Slice(x, start1, end1, axes1, _allow_other_inputs=True)
        second = op.Slice(x, start2, end2, axes2, _allow_other_inputs=True)
        rotated = op.Concat(op.Neg(second), first, _allow_other_attributes=True, _outputs=["cat"])
        return op.Add(op.Mul(x, cos), op.Mul(rotated, sin))

    def check(self, context, x, cos, sin, start1, end1, axes1, start2, end2, axes2, cat, **_):
        result = pattern.MatchResult()
        dims = _dims(x)
        if dims is None or len(dims) != 4 or dims[0] != 1:
            return result.fail("x is not [1, heads, tokens, head_size]", x)
        heads, size = _static(dims[1]), _static(dims[3])
        if heads is None or size is None or size % 2:
            return result.fail("heads or an even head size is not static", x)
        if x.dtype not in _FLOATS:
            return result.fail("x is not a float tensor", x)
        half = size // 2
        last_axis = ([3], [-1])
        if (
            _ints(start1) != [0]
            or _ints(end1) != [half]
            or _ints(start2) != [half]
            or (_ints(end2) or [0])[0] < size
            or _ints(axes1) not in last_axis
            or _ints(axes2) not in last_axis
        ):
            return result.fail("the slices are not the two halves of the head dim")
        if cat.producer().attributes.get_int("axis", 0) not in (3, -1):
            return result.fail("the concat is not over the head dim")
        for table in (cos, sin):
            table_dims = _dims(table)
            if (
                table_dims is None
                or len(table_dims) != 4
                or table_dims[0] != 1
                or table_dims[1] != 1
                or table_dims[3] != size
                or table.dtype != x.dtype
            ):
                return result.fail("cos/sin are not [1, 1, tokens, head_size] of x's dtype", table)
        return result

    def rewrite(self, op, x, cos, sin, **_):
        _, heads, tokens, size = _dims(x)
        heads_first = op.Reshape(
            op.Transpose(x, perm=[0, 2, 1, 3]), _constant(op, [-1, heads, size])
        )
        tables = [op.Reshape(t, _constant(op, [-1, size])) for t in (cos, sin)]
        rotated = _custom(op, "NeoxRotaryEmbedding", heads_first, *tables)
        _typed(rotated, x, [tokens, heads, size])
        back = op.Reshape(rotated, _constant(op, [1, -1, heads, size]))
        return op.Transpose(back, perm=[0, 2, 1, 3])


class QkvRotaryEmbedding(pattern.RewriteRuleClassBase):
    """The heads of a fused q/k/v projection ``qkv [..., (H + 2 Hkv) * D]`` split three ways,
    q and k rotated, v reshaped -> one ``NeoxQKVRotaryEmbedding``."""

    def pattern(self, op, qkv, sizes, shape_q, shape_k, shape_v, cos, sin):
        query, key, value = op.Split(qkv, sizes, _allow_other_attributes=True, _outputs=3)
        rotate = {"_domain": DOMAIN}
        return (
            op.NeoxRotaryEmbedding(op.Reshape(query, shape_q), cos, sin, **rotate),
            op.NeoxRotaryEmbedding(op.Reshape(key, shape_k), cos, sin, **rotate),
            op.Reshape(value, shape_v, _outputs=["value_heads"]),
        )

    def check(self, context, qkv, sizes, shape_q, shape_k, shape_v, value_heads, **_):
        result = pattern.MatchResult()
        dims = _dims(qkv)
        widths = _ints(sizes)
        shapes = [_ints(s) for s in (shape_q, shape_k, shape_v)]
        if dims is None or widths is None or len(widths) != 3 or None in shapes:
            return result.fail("the split or the head shapes are not constant")
        split = value_heads.producer().inputs[0].producer()
        if split.attributes.get_int("axis", 0) not in (-1, len(dims) - 1):
            return result.fail("the split is not over the last axis")
        if any(len(s) != 3 or s[0] != -1 for s in shapes):
            return result.fail("the heads are not reshaped to [-1, heads, head_size]")
        (_, heads, size), (_, kv_heads, k_size), (_, v_heads, v_size) = shapes
        if (k_size, v_size, v_heads) != (size, size, kv_heads):
            return result.fail("k and v heads differ in shape")
        if widths != [heads * size, kv_heads * size, kv_heads * size]:
            return result.fail("the split is not [H * D, Hkv * D, Hkv * D]")
        self._geometry = {"num_heads": heads, "num_kv_heads": kv_heads, "head_size": size}
        return result

    def rewrite(self, op, qkv, cos, sin, value_heads, **_):
        width = (
            sum(self._geometry[k] for k in ("num_heads", "num_kv_heads", "num_kv_heads"))
            * self._geometry["head_size"]
        )
        rows = op.Reshape(qkv, _constant(op, [-1, width]))
        outputs = _custom(op, "NeoxQKVRotaryEmbedding", rows, cos, sin, outputs=3, **self._geometry)
        tokens = (_dims(value_heads) or ("tokens",))[0]
        size = self._geometry["head_size"]
        for out, heads in zip(
            outputs,
            (
                self._geometry["num_heads"],
                self._geometry["num_kv_heads"],
                self._geometry["num_kv_heads"],
            ),
            strict=True,
        ):
            _typed(out, qkv, [tokens, heads, size])
        return tuple(outputs)


# ----------------------------------------------------------------------------- MLP and norms


class SiluAndMul(pattern.RewriteRuleClassBase):
    """``silu(gate) * up`` (``gate * Sigmoid(gate)``) of the two halves of one tensor, split over
    its last axis -> ``SiluAndMul`` of the tensor."""

    def pattern(self, op, x, sizes):
        gate, up = op.Split(x, sizes, _allow_other_attributes=True, _outputs=["gate", "up"])
        return op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)

    def check(self, context, x, sizes, gate, **_):
        result = pattern.MatchResult()
        dims, halves = _dims(x), _ints(sizes)
        if dims is None or len(dims) < 2 or x.dtype not in _FLOATS:
            return result.fail("x is not a float tensor of 2 or more dims", x)
        if halves is None or len(halves) != 2 or halves[0] != halves[1]:
            return result.fail("the split is not into two equal halves")
        if gate.producer().attributes.get_int("axis", 0) not in (-1, len(dims) - 1):
            return result.fail("the split is not over the last axis")
        return result

    def rewrite(self, op, x, sizes, **_):
        out = _custom(op, "SiluAndMul", x)
        return _typed(out, x, [*_dims(x)[:-1], _ints(sizes)[0]])


def _rms_norm_pattern(op, x, weight, two, axes, epsilon):
    """transformers' RMSNorm of x: in float32 (a Cast when x is not), ``x * 1 / sqrt(mean(x^2)
    + eps)``, back to x's dtype, times the weight."""
    wide = pattern.OrValue([op.Cast(x, _allow_other_attributes=True), x], tag_var="widened")
    mean_square = op.ReduceMean(op.Pow(wide, two), axes, _allow_other_attributes=True)
    inverse = op.Reciprocal(op.Sqrt(op.Add(mean_square, epsilon)))
    normed = op.Mul(wide, inverse)
    narrow = pattern.OrValue(
        [op.Cast(normed, _allow_other_attributes=True), normed], tag_var="narrowed"
    )
    return op.Mul(weight, narrow)


def _check_rms_norm(x, weight, two, axes, epsilon, widened, narrowed) -> pattern.MatchResult:
    """What the fused norm computes: float32 math (casts exactly when x is not float32), the
    last axis, a scalar epsilon, a ``[hidden]`` weight of x's dtype."""
    result = pattern.MatchResult()
    dims = _dims(x)
    if dims is None or len(dims) < 2 or x.dtype not in _FLOATS:
        return result.fail("x is not a float tensor of 2 or more dims", x)
    if (widened == 0) != (x.dtype != ir.DataType.FLOAT) or (narrowed == 0) != (widened == 0):
        return result.fail("the norm is not computed in float32 and cast back")
    if _scalar(two) != 2.0 or _ints(axes) not in ([-1], [len(dims) - 1]):
        return result.fail("not the mean square over the last axis")
    if _scalar(epsilon) is None:
        return result.fail("epsilon is not a constant scalar")
    if weight.dtype != x.dtype or _dims(weight) != (dims[-1],):
        return result.fail("the weight is not [hidden] of x's dtype", weight)
    return result


class RmsNorm(pattern.RewriteRuleClassBase):
    """transformers' RMSNorm -> a marker node (``RMSNorm`` of :data:`MARKER_DOMAIN`) that
    :func:`fuse_rms_norms` then turns into ``FusedAddRMSNorm`` when a residual ``Add`` makes
    its input, else into the ``Div`` form. (One pattern rule with the ``Add`` and both of its
    outputs would be a multi-output pattern, which onnxscript's matcher searches two orders of
    magnitude slower.)"""

    def pattern(self, op, x, weight, two, axes, epsilon):
        return _rms_norm_pattern(op, x, weight, two, axes, epsilon)

    def check(self, context, x, weight, two, axes, epsilon, **tags):
        return _check_rms_norm(x, weight, two, axes, epsilon, **_tags(tags))

    def rewrite(self, op, x, weight, epsilon, **_):
        marker = op.RMSNorm(x, weight, epsilon=_scalar(epsilon), _domain=MARKER_DOMAIN)
        return _typed(marker, x, list(_dims(x)))


MARKER_DOMAIN = "attnexport.fusions"
"""The domain of the marker nodes :func:`fuse` leaves for its passes (none survives it)."""


def _residual_add(x: ir.Value) -> ir.Node | None:
    """The standard ``Add`` of two tensors of x's shape and dtype that produces x, if any."""
    add = x.producer()
    if not is_standard(add, "Add"):
        return None
    a, b = add.inputs
    if _dims(a) != _dims(x) or _dims(b) != _dims(x) or a.dtype != x.dtype != b.dtype:
        return None
    return add


def fuse_rms_norms(model: ir.Model) -> tuple[int, int]:
    """Replaces each RMSNorm marker: ``FusedAddRMSNorm(a, b, weight)`` when its input is a
    residual ``Add(a, b)`` (the sum's other users read the node's second output), else
    ``weight * x / sqrt(mean(x^2) + eps)`` in float32 (the zoo's form: onnxruntime fuses it into
    one SimplifiedLayerNormalization; it leaves transformers' ``Reciprocal`` form unfused).
    Returns (fused adds, plain norms)."""
    graph = model.graph
    counts = [0, 0]
    for marker in [n for n in graph if n.domain == MARKER_DOMAIN]:
        x, weight = marker.inputs
        epsilon = marker.attributes.get_float("epsilon")
        add = _residual_add(x)
        if add is not None:
            fused = ir.Node(
                DOMAIN,
                "FusedAddRMSNorm",
                [*add.inputs, weight],
                attributes=[ir.AttrFloat32("epsilon", epsilon)],
                num_outputs=2,
                name=f"{add.name}/FusedAddRMSNorm",
            )
            graph.insert_before(marker, fused)
            outputs = [(marker.outputs[0], fused.outputs[0]), (x, fused.outputs[1])]
            counts[0] += 1
        else:
            nodes, result = _div_form(graph, x, weight, epsilon, marker.name)
            graph.insert_before(marker, nodes)
            outputs = [(marker.outputs[0], result)]
            counts[1] += 1
        for old, new in outputs:
            new.type, new.shape = old.type, old.shape
            ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
        graph.remove([marker, *([add] if add is not None else [])], safe=True)
    return counts[0], counts[1]


def _div_form(graph: ir.Graph, x: ir.Value, weight: ir.Value, epsilon: float, name: str):
    def constant(array, suffix):
        return ir.Value(
            name=f"{name}/{suffix}",
            const_value=ir.tensor(array, name=f"{name}/{suffix}"),
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
        )

    two = constant(np.array(2.0, dtype=np.float32), "two")
    axes = constant(np.array([-1], dtype=np.int64), "axes")
    eps = constant(np.array(epsilon, dtype=np.float32), "epsilon")
    for value in (two, axes, eps):
        graph.register_initializer(value)
    nodes = []

    def node(op_type, *inputs, **attributes):
        attrs = [ir.Attr(k, ir.AttributeType.INT, v) for k, v in attributes.items()]
        created = ir.Node("", op_type, list(inputs), attributes=attrs, name=f"{name}/{op_type}")
        nodes.append(created)
        return created.outputs[0]

    wide = x if x.dtype == ir.DataType.FLOAT else node("Cast", x, to=ir.DataType.FLOAT.value)
    mean_square = node("ReduceMean", node("Pow", wide, two), axes, keepdims=1)
    normed = node("Div", wide, node("Sqrt", node("Add", mean_square, eps)))
    if x.dtype != ir.DataType.FLOAT:
        normed = node("Cast", normed, to=x.dtype.value)
    return nodes, node("Mul", weight, normed)


def _tags(tags: dict) -> dict:
    return {"widened": tags.get("widened"), "narrowed": tags.get("narrowed")}


# ----------------------------------------------------------------------------- layout


class NoopReshape(pattern.RewriteRuleClassBase):
    """``Reshape(x, shape)`` to the shape x has: a constant shape of x's rank whose entries
    are x's static dims but for at most one -1 (which must then stand for the remaining
    dim)."""

    def pattern(self, op, x, shape):
        return op.Reshape(x, shape, _allow_other_attributes=True)

    def check(self, context, x, shape):
        result = pattern.MatchResult()
        dims, target = _dims(x), _ints(shape)
        if dims is None or target is None or len(dims) != len(target):
            return result.fail("not a constant shape of x's rank")
        if target.count(-1) > 1 or any(
            t != -1 and t != d for t, d in zip(target, dims, strict=True)
        ):
            return result.fail("the shape is not x's")
        return result

    def rewrite(self, op, x, shape):
        return op.Identity(x)


_LAYOUT = (
    _basic_rules.transpose_transpose_rule,
    _basic_rules.no_op_transpose_rule,
    _basic_rules.reshape_reshape_rule,
    NoopReshape.rule(),
)

FUSION_RULES: dict[str, tuple[pattern.RewriteRule, ...]] = {
    "rotary": (anchored_rule(RotaryEmbedding),),
    "qkv_rotary": (anchored_rule(QkvRotaryEmbedding),),
    "silu_and_mul": (anchored_rule(SiluAndMul),),
    "rms_norm_marker": (anchored_rule(RmsNorm),),
}
"""The pattern rules, in the order :func:`fuse` applies them (each one to a fixed point)."""


def _apply(rules, model: ir.Model) -> int:
    ruleset = pattern.RewriteRuleSet(list(rules), commute=True)
    total = 0
    while count := ruleset.apply_to_model(model):
        total += count
    return total


def _apply_layout(model: ir.Model) -> None:
    """The layout rules and identity removal, to a fixed point (a folded transpose pair
    leaves an Identity that hides the reshapes around it from the rules)."""
    while _apply(_LAYOUT, model):
        common_passes.IdentityEliminationPass()(model)


_TIDY = ir.passes.Sequential(
    common_passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
    common_passes.DeduplicateInitializersPass(),
    common_passes.CommonSubexpressionEliminationPass(),
    common_passes.RemoveUnusedNodesPass(),
)
"""After each rule: the rewrites' constants as initializers, shared, and their repeated
nodes (every layer reshapes the same cos/sin tables) computed once."""


def fuse(model: ir.Model) -> dict[str, int]:
    """Applies the rules of the module doc to ``model``'s main graph (in place); returns
    ``{rule: times it fired}`` for the rules that fired."""
    fired = {"sibling_matmuls": fuse_sibling_matmuls(model)}
    for name, rules in FUSION_RULES.items():
        fired[name] = _apply(rules, model)
        if fired[name]:
            _TIDY(model)  # first: the layout rules read the rewrites' shapes as initializers
            _apply_layout(model)
            _TIDY(model)
    del fired["rms_norm_marker"]
    fired["add_rms_norm"], fired["rms_norm"] = fuse_rms_norms(model)
    return {name: count for name, count in fired.items() if count}
