"""``to_onnx``: a model on the attnexport ops -> an ONNX file that stock onnxruntime runs.

Pipeline (each step answers a trap of docs/traps.md)::

    export_program            torch.export + cache checks (caches are forward inputs)
    functionalize_cache_writes in-place reshape_and_cache -> functional twin + copy_
    torch.onnx.export         optimize=False, custom translations -> attnexport nodes (its
                              decomposition retrace skipped where nothing needs it:
                              onnx_translation)
    drop_absent_scale_outputs float-cache writes keep their two cache outputs only
    connect_caches_directly   drop torch's no-op copies between caches and their users
    expose_cache_writes       last write of cache input X -> graph output X_out
    transpose_weights         Transpose(W) of a Linear weight -> the initializer W.T (names kept)
    optimize_ir               onnxscript's optimizer (after exposing, so nothing is dropped;
                              its multi-output rules matched in linear time: rule_matching)
    gemm_to_matmul            nn.Linear's Gemm -> MatMul on a constant [in, out] weight (what
                              onnxruntime's weight quantizer rewrites)
    fusions.fuse              rewrite rules: transformers' standard-op patterns -> the fused
                              attnexport nodes (the transformers path's graphs)
    rename_dims, name_outputs readable dimension and output names
    apply_target              attach bodies / inline them / map to com.microsoft
    pack_float_weights        (optional) float32 MatMul weights -> panels of PackedMatMul
    code_packed_weights       (optional) panels with an exact low-bit form -> LosslessMatMul*
    graph contract, IR 10     metadata_props; then save, full onnx.checker, in-place check
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, TensorArgument
from torch.utils import _pytree as pytree

from attnexport.lowering import (
    fusions,
    naming,
    onnx_passes,
    onnx_translation,
    packed_matmul,
    rule_matching,
)
from attnexport.lowering.domain_functions import EXTERNAL_DATA_BYTES
from attnexport.lowering.export import DIM_NAMES_META, export_program
from attnexport.lowering.lossless_weights import code_packed_weights
from attnexport.lowering.model_contract import GraphContract, cache_geometry
from attnexport.lowering.passes import check_program, functionalize_cache_writes
from attnexport.lowering.targets import apply_target, check_target
from attnexport.model_interface import CacheSpec

IR_VERSION = 10
"""ONNX IR version of the files (onnx 1.23 writes newer ones than onnxruntime 1.31 reads)."""
DEFAULT_OPSET = 18


def _sample_inputs(program: ExportedProgram) -> dict[str, torch.Tensor]:
    """``{input name: sample tensor}`` from the program's example inputs, or else the fake
    tensors the export recorded (same static dims and dtype)."""
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    leaves = pytree.tree_leaves(program.example_inputs) if program.example_inputs else []
    if len(leaves) != len(specs):
        placeholders = {
            n.name: n.meta.get("val") for n in program.graph.find_nodes(op="placeholder")
        }
        leaves = [placeholders.get(getattr(spec.arg, "name", None)) for spec in specs]
    return {
        spec.arg.name: leaf
        for spec, leaf in zip(specs, leaves, strict=True)
        if isinstance(spec.arg, TensorArgument) and isinstance(leaf, torch.Tensor)
    }


def _activation_dtype(program: ExportedProgram) -> torch.dtype | None:
    """The dtype of the keys the program writes into its caches (the model's activations),
    which the caches may not share (``--kv-cache-dtype``); None without a cache write."""
    for node in program.graph.nodes:
        if (
            node.op == "call_function"
            and node.target == torch.ops.attnexport.reshape_and_cache.default
        ):
            value = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
            if isinstance(value, torch.Tensor):
                return value.dtype
    return None


def _save(model: ir.Model, path: Path, step: Callable[[str], None]) -> onnx.ModelProto:
    step(f"saving {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    weights = sum(
        value.const_value.nbytes
        for value in model.graph.initializers.values()
        if value.const_value is not None
    )
    external = weights > EXTERNAL_DATA_BYTES
    if external:
        ir.save(model, path, external_data=f"{path.name}.data")
    else:
        ir.save(model, path)
    step(f"checking {path.name} (onnx.checker)")
    onnx.checker.check_model(str(path), full_check=True)
    return onnx.load(str(path), load_external_data=not external)


def to_onnx(
    module_or_program: torch.nn.Module | ExportedProgram,
    args: tuple,
    path: str | os.PathLike,
    *,
    dynamic_shapes=None,
    target: str = "attnexport",
    kwargs: Mapping | None = None,
    output_names: Sequence[str] | None = None,
    metadata: Mapping[str, str] | None = None,
    cache_spec: CacheSpec | None = None,
    opset_version: int = DEFAULT_OPSET,
    fuse: bool = True,
    prefill_attention: str = "float32",
    pack_float_weights: bool = False,
    lossless_weights: bool = False,
    step: Callable[[str], None] = lambda _description: None,
) -> onnx.ModelProto:
    """Exports a model on the attnexport ops to an ONNX file that stock onnxruntime runs.

    Graph inputs are the forward's arguments (a list argument ``kv_caches`` flattens to
    ``kv_caches_0``, ``kv_caches_1``, ...); each cache input ``X`` the model writes is also
    the output ``X_out``. Bind one buffer to both (see :mod:`attnexport.lowering.ort_session`)
    and the write happens in place.

    Args:
        module_or_program: an ``nn.Module`` (exported with :func:`export_program`) or an
            ``ExportedProgram`` from it (whose example inputs then stand for ``args``).
        args: sample positional inputs (see :func:`export_program`).
        path: where to write the ``.onnx`` file (weights over 64 MiB go to ``<path>.data``).
        dynamic_shapes: see :func:`export_program`; only for a module.
        target: ``"attnexport"`` (custom nodes + function bodies), ``"standard"`` (bodies
            inlined) or ``"ort-cuda"`` (``com.microsoft.PagedAttention`` where possible).
        kwargs: sample keyword inputs.
        output_names: names of the model's outputs (default ``output`` / ``output_<i>``).
        metadata: extra ``metadata_props`` (e.g. ``{"architecture": "llama"}``).
        cache_spec: the model's cache geometry, checked against the samples and recorded
            (``num_layers``/``num_cross_layers`` are otherwise inferred from the cache count).
            A module's ``rope_switch_length`` (LongRoPE) is recorded too.
        opset_version: standard ONNX opset (>= 18).
        fuse: apply the rewrite rules of :mod:`attnexport.lowering.fusions` (standard-op
            patterns of transformers' modeling code -> the fused attnexport nodes); the graph
            contract records which fired (``fusions``).
        prefill_attention: ``"float32"`` or ``"bfloat16"``: the native PagedAttention kernel
            multiplies prefills in bfloat16 pairs where the CPU has AVX512_BF16 (the nodes'
            ``prefill_bf16``; not with the ``standard`` target, which has no such node).
        pack_float_weights: store the float32 projections' weights in panels of 32 columns
            for ``attnexport.PackedMatMul`` (the native kernel's layout; target ``attnexport``
            only; the quantizer turns them back: :mod:`attnexport.lowering.packed_matmul`).
        lossless_weights: with ``pack_float_weights``, store each panel weight that is exactly
            4- or 8-bit codes with float16 block scales and offsets (a checkpoint de-quantized
            from GGUF) as those codes, for ``attnexport.LosslessMatMul*`` (the same float32
            numbers and outputs, 3.5-6x fewer bytes: :mod:`attnexport.lowering.lossless_weights`).
        step: called with a description as each long stage starts (progress display).

    Returns:
        The saved ``onnx.ModelProto`` (without its weights when they went to external data).

    Raises:
        ValueError: bad target, a cache captured as a constant or not exposed, or any
            :func:`export_program` error.
    """
    check_target(target)
    if lossless_weights and not pack_float_weights:
        raise ValueError("lossless_weights: codes the float32 panels (pack_float_weights=True)")
    if pack_float_weights and target != "attnexport":
        raise ValueError(
            f"pack_float_weights: the panels are read by the native PackedMatMul kernel; target "
            f"{target!r} has no such node (use target attnexport)"
        )
    if prefill_attention != "float32" and target == "standard":
        raise ValueError(
            f"prefill_attention {prefill_attention!r}: an option of the native PagedAttention "
            "kernel; the standard target inlines its nodes (use target attnexport)"
        )
    if isinstance(module_or_program, ExportedProgram):
        if dynamic_shapes is not None:
            raise ValueError(
                "dynamic_shapes: only used when exporting a module; this ExportedProgram "
                "already has its shapes"
            )
        program = module_or_program
    else:
        program = export_program(
            module_or_program, args, dynamic_shapes=dynamic_shapes, kwargs=kwargs
        )
    caches = check_program(program)
    samples = _sample_inputs(program)
    geometry = cache_geometry(
        {n: samples[n] for n in caches.inputs if n in samples},
        cache_spec,
        _activation_dtype(program),
    )

    step("torch.onnx translation")
    functional, _ = functionalize_cache_writes(program)
    from attnexport.lowering.registry import translation_table

    model, _direct = onnx_translation.translate(functional, translation_table(), opset_version)
    torch_weights = list(model.graph.initializers.values())
    step("cache outputs, weights, onnxscript optimizer")
    onnx_passes.drop_absent_scale_outputs(model)
    onnx_passes.connect_caches_directly(model)
    cache_outputs = onnx_passes.expose_cache_writes(model, caches.written)

    onnx_passes.transpose_weights(model)
    rule_matching.optimize(model)
    onnx_passes.gemm_to_matmul(model)
    step("fusions, names, target")
    fired = fusions.fuse(model) if fuse else {}
    naming.rename_dims(
        model, naming.input_dim_names(program), program.graph_module.meta.get(DIM_NAMES_META, {})
    )
    onnx_passes.name_outputs(model, cache_outputs, output_names)
    onnx_passes.set_prefill_attention(model, prefill_attention)
    notes = apply_target(model, target)
    if pack_float_weights:  # (after the target: its checks know the torch ops' nodes only)
        packed_matmul.pack_float_weights(model)
        if lossless_weights:
            step("float32 weights with an exact low-bit form -> their codes")
            code_packed_weights(model)

    model.ir_version = IR_VERSION
    model.producer_name = "attnexport"
    contract = GraphContract(
        target=target,
        cache_inputs=caches.inputs,
        cache_outputs=cache_outputs,
        outputs=tuple(v.name for v in model.graph.outputs if v.name not in cache_outputs.values()),
        extra=dict(metadata or {}),
        rope_switch_length=getattr(module_or_program, "rope_switch_length", None),
        fusions=fired,
        **geometry,
    )
    model.metadata_props.update(contract.to_props())
    if notes:
        model.metadata_props["target_notes"] = "\n".join(notes)
    proto = _save(model, Path(path), step)
    _release_weights([*torch_weights, *model.graph.initializers.values()])
    onnx_passes.check_cache_io(proto, caches.inputs, cache_outputs)
    return proto


def _release_weights(values: list[ir.Value]) -> None:
    """Drops the tensors of the saved IR model's weights (torch.onnx's wrap the torch model's
    tensors, ``<W>.T`` reads them): onnxscript's rewrite rules are module-level objects that
    keep their last match, and through it the graph, alive after the call, and the graph keeps
    every value that was once its input (torch.onnx's weights were), which kept every torch
    weight alive through ``--weights``' quantization (a second float copy of the weights)."""
    for value in values:
        value.const_value = None
