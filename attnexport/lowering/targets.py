"""Export targets: what the attnexport nodes become in the saved file.

* ``attnexport`` (default): the custom nodes, with their standard-op bodies attached as model
  functions. Stock onnxruntime inlines the bodies; a runtime with kernels for the
  ``attnexport`` domain uses its kernels instead.
* ``standard``: the bodies inlined; only standard ONNX ops remain, for other runtimes.
* ``ort-cuda``: each cache write + paged attention pair that onnxruntime's
  ``com.microsoft.PagedAttention`` (CUDA execution provider, fp16/bf16) can compute becomes that
  node; every other attnexport node keeps its body (see :mod:`attnexport.lowering.ort_cuda`).
"""

from __future__ import annotations

import onnx_ir as ir
from onnx_ir.passes.common import InlinePass

from attnexport.lowering.registry import DOMAIN, DOMAIN_VERSION, all_bodies

TARGETS = ("attnexport", "standard", "ort-cuda")


def check_target(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"target: expected one of {', '.join(TARGETS)}, got {target!r}")
    return target


def _used_ops(model: ir.Model) -> set[str]:
    return {
        node.op_type
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if node.domain == DOMAIN
    }


def _all_or_none(model: ir.Model, kind: str, refusal: str) -> bool:
    """Whether the graph's attnexport nodes with optional inputs of port ``kind`` (``scale``:
    the int8 caches' scale caches; ``sinks``: attention sinks) have them. A graph whose nodes
    disagree is refused with ``refusal``: an ONNX function has one body, and the body cannot
    test for an omitted input."""
    from attnexport.lowering.registry import onnx_ops

    ops = onnx_ops()
    found = set()
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN:
            continue
        ports = [i for i, port in enumerate(ops[node.op_type].inputs) if getattr(port, kind)]
        if ports:
            inputs = node.inputs
            found.add(any(i < len(inputs) and inputs[i] is not None for i in ports))
    if len(found) > 1:
        raise ValueError(refusal)
    return found == {True}


def _scaled(model: ir.Model) -> bool:
    """Whether the graph's paged nodes have scale-cache inputs (int8 KV caches)."""
    refusal = (
        "kv caches: some paged nodes have scale caches (int8) and others not; a model must use "
        "one KV cache dtype"
    )
    return _all_or_none(model, "scale", refusal)


def _sinks(model: ir.Model) -> bool:
    """Whether the graph's attention nodes have attention sinks."""
    refusal = (
        "attention sinks: some attention nodes have them and others not; the layers of a "
        "model must all have sinks or none"
    )
    return _all_or_none(model, "sinks", refusal)


def attach_bodies(model: ir.Model) -> None:
    """Adds the function bodies of the attnexport ops the graph uses (the int8-cache variants
    when its paged nodes have scale caches)."""
    used = _used_ops(model)
    if not used:
        model.opset_imports.pop(DOMAIN, None)
        return
    model.opset_imports[DOMAIN] = DOMAIN_VERSION
    for function in all_bodies(model.opset_imports[""], _scaled(model), _sinks(model)):
        if function.name in used:
            model.functions[function.identifier()] = function


def apply_target(model: ir.Model, target: str) -> list[str]:
    """Rewrites ``model`` in place for ``target``; returns notes for the caller (why some
    nodes were not mapped, for ``ort-cuda``)."""
    check_target(target)
    notes: list[str] = []
    if target == "ort-cuda":
        from attnexport.lowering.ort_cuda import map_paged_attention

        notes = map_paged_attention(model)
    attach_bodies(model)
    if target == "standard":
        InlinePass()(model)
        for key in [k for k in model.functions if k[0] == DOMAIN]:
            del model.functions[key]
        model.opset_imports.pop(DOMAIN, None)
        left = _used_ops(model)
        if left:
            raise RuntimeError(f"standard target: attnexport nodes {sorted(left)} not inlined")
    return notes
