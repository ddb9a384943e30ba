"""Writing an export directory: the model files, the tokenizer files and the manifest
(``attnexport export``), all into a staging directory moved into place when complete
(:mod:`attnexport.artifact.staging`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from attnexport.artifact.errors import ArtifactError
from attnexport.artifact.files import ONNX_FILE, PT2_FILE, TOKENIZER_FILES
from attnexport.artifact.heap import cycle_collection_paused, return_freed_memory
from attnexport.artifact.manifest import (
    FORMAT,
    FORMAT_VERSION,
    cache_entry,
    dtype_name,
    generation_defaults,
    library_versions,
    model_file_digests,
    read_manifest,
    write_manifest,
)
from attnexport.artifact.pt2 import save_pt2
from attnexport.artifact.staging import earlier_export, publish, staging_directory
from attnexport.contained_files import contained_file

if TYPE_CHECKING:
    from attnexport.lowering.quantize import WeightQuantization

# dtypes whose ONNX model onnxruntime's CPU provider cannot run (the attnexport and standard
# targets run there), with the reason; float16 runs (`verify` passes).
CPU_UNRUNNABLE = {
    torch.bfloat16: "onnxruntime's CPU provider has no bfloat16 kernels for the model's ops "
    "(e.g. Mul), so the exported model could not run",
}


@dataclass(frozen=True)
class ExportOptions:
    """What ``attnexport export`` was asked for."""

    formats: tuple[str, ...] = ("onnx",)
    target: str = "attnexport"
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: str = "auto"
    """The KV caches' dtype name (``KV_CACHE_DTYPES``); ``auto``: ``dtype``."""
    block_size: int = 16
    seed: int = 0
    overwrite: bool = False
    weights: WeightQuantization | None = None
    """Weight-only quantization of the ONNX model (None: float weights)."""
    prefill_attention: str = "float32"
    """How the native PagedAttention kernel multiplies prefills: ``float32`` or ``bfloat16``
    (bfloat16 pairs where the CPU has AVX512_BF16; ONNX only)."""
    lossless_weights: bool = True
    """Float32 ONNX exports (target attnexport): store each projection whose weights are exactly
    4- or 8-bit codes with float16 block parameters (a checkpoint de-quantized from GGUF) as
    those codes (``attnexport.LosslessMatMul*``: the same numbers, 3.5-6x fewer bytes)."""
    impl: str = "auto"
    """How a checkpoint is loaded (``attnexport.models.registry.IMPLS``): the zoo's network,
    transformers' with its attention on the paged ops, or ``auto`` (the zoo where it has the
    family, else transformers)."""


def export_artifact(
    model_ref: str,
    out: Path,
    options: ExportOptions,
    *,
    step: Callable[[str], None] = lambda _: None,
) -> dict:
    """Exports zoo model or checkpoint ``model_ref`` into directory ``out``; returns the
    manifest. ``step(description)`` is called before each long step (for progress display).

    The files are written into a staging directory and moved into ``out`` only when all are
    written (:mod:`attnexport.artifact.staging`): an export that fails or is interrupted
    leaves ``out`` as it was. A checkpoint's files are read only when they are its own
    (:mod:`attnexport.contained_files`)."""
    with cycle_collection_paused():
        return _export_artifact(model_ref, out, options, step)


def _export_artifact(
    model_ref: str, out: Path, options: ExportOptions, step: Callable[[str], None]
) -> dict:
    from attnexport import lowering
    from attnexport.models import load_checkpoint, load_zoo_model, resolve_model_ref

    if options.target not in lowering.TARGETS:
        raise ArtifactError(
            f"--target: expected {', '.join(lowering.TARGETS)}, got {options.target!r}"
        )
    if options.block_size < 1:
        raise ArtifactError(f"--block-size: expected a positive integer, got {options.block_size}")
    if (
        "onnx" in options.formats
        and options.dtype in CPU_UNRUNNABLE
        and options.target != "ort-cuda"
    ):
        raise ArtifactError(
            f"--dtype {dtype_name(options.dtype)} with ONNX: {CPU_UNRUNNABLE[options.dtype]}; "
            "export with --dtype float32 (or float16) for onnxruntime, --format pt2 to run "
            f"{dtype_name(options.dtype)} with torch, or --target ort-cuda for onnxruntime's "
            "CUDA provider"
        )
    if options.weights is not None and options.formats != ("onnx",):
        raise ArtifactError(
            f"--weights {options.weights.format}: quantization applies to the ONNX model only; "
            "export it with --format onnx"
        )
    if options.weights is not None and options.dtype != torch.float32:
        raise ArtifactError(
            f"--weights {options.weights.format} with --dtype {dtype_name(options.dtype)}: "
            "quantized exports are made from float32 models"
        )
    if options.prefill_attention != "float32" and (
        "onnx" not in options.formats or options.target == "standard"
    ):
        raise ArtifactError(
            f"--prefill-attention {options.prefill_attention}: an option of the native "
            "PagedAttention kernel, in the ONNX file's attnexport nodes (--format onnx, a "
            "--target other than standard)"
        )
    kv_cache_dtype = _kv_cache_dtype(options)
    earlier_export(out, overwrite=options.overwrite)
    kind, ref = resolve_model_ref(model_ref)
    source = ref if kind == "checkpoint" else None
    if source is None and options.impl == "transformers":
        raise ArtifactError(
            f"--impl transformers: {model_ref} is a zoo name; the transformers path exports a "
            "checkpoint directory"
        )
    step(f"loading {'checkpoint ' + str(ref) if source else 'zoo model ' + str(ref)}")
    model = (
        load_checkpoint(ref, dtype=options.dtype, impl=options.impl)
        if source
        else load_zoo_model(str(ref), dtype=options.dtype, seed=options.seed)
    )
    check_finite_weights(model, model_ref)
    embedding = None
    if model.kind == "encoder":  # how `embed` pools, read before the long steps
        from attnexport.models.sentence import DEFAULT_EMBEDDING, read_embedding_config

        embedding = read_embedding_config(source) if source else dict(DEFAULT_EMBEDDING)
    generation = generation_defaults(source, model)
    # checked before the long steps: a link out of the checkpoint is refused, never copied
    tokenizer_files = {
        name: path
        for name in (TOKENIZER_FILES if source is not None else ())
        if (path := contained_file(source, name, hub_links=True)).is_file()
    }
    identity = {
        "architecture": model.zoo_name,
        "kind": model.kind,
        "impl": model.impl,
        **({"impl_note": model.zoo_refusal} if model.zoo_refusal else {}),
    }
    limits = {
        "vocab_size": getattr(model.config, "vocab_size", None),
        "max_model_len": model.max_model_len,
        "rope_switch_length": model.rope_switch_length,
    }
    with staging_directory(out) as stage:
        written = _write_export(model, stage, options, kv_cache_dtype, step)
        del model  # the torch weights are not needed past the lowering
        if options.weights is not None:
            # their pages returned before the quantizer reads the ONNX weights (a float export
            # has nothing left to allocate: the collection would only cost time, ~0.3 s)
            return_freed_memory()
            step(f"quantizing the weights ({options.weights.format})")
            start = time.perf_counter()
            try:
                written["weights"] = lowering.quantize_weights(stage / ONNX_FILE, options.weights)
            except lowering.QuantizationError as error:
                raise ArtifactError(str(error)) from None
            written["export_seconds"]["quantize"] = round(time.perf_counter() - start, 3)
        step("writing the manifest")
        written["file_digests"] = model_file_digests(stage, written["files"])
        for name, path in tokenizer_files.items():
            shutil.copy2(path, stage / name)
        timings = written.pop("export_seconds")
        source_entry = (
            {"kind": "checkpoint", "path": str(source.resolve())}
            if source is not None
            else {"kind": "zoo", "name": str(ref), "seed": options.seed}
        )
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            **identity,
            "source": source_entry,
            **written,  # dtypes, config, cache, target, files, weights, digests, inputs
            **limits,
            "generation": generation,
            **({"embedding": embedding} if embedding is not None else {}),
            "tokenizer_files": [n for n in tokenizer_files if n != "generation_config.json"],
            "versions": library_versions(),
            "export_seconds": timings,
        }
        write_manifest(stage, manifest)
        publish(stage, out)
    return manifest


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def _write_export(
    model, stage: Path, options: ExportOptions, kv_cache_dtype, step: Callable[[str], None]
) -> dict:
    """Writes the model files of ``model`` into ``stage`` (float weights); returns the
    manifest's entries about them (dtypes, config, cache, target, files, digests, inputs,
    export times)."""
    from attnexport import lowering

    sample = model.export_sample(options.block_size, kv_cache_dtype)
    cache_spec = (
        model.cache_spec(options.block_size, kv_cache_dtype) if model.kind != "encoder" else None
    )
    timings = {}
    step("torch.export")
    start = time.perf_counter()
    try:
        program = lowering.export_program(model, sample.args, dynamic_shapes=sample.dynamic_shapes)
    except GuardOnDataDependentSymNode as error:
        from attnexport.models.errors import UnsupportedModelError

        name = type(getattr(model, "hf_model", model)).__name__
        raise UnsupportedModelError(
            f"{name}: torch.export cannot trace its forward: it branches on the values of "
            f"tensors (data-dependent control flow), which one graph for every step cannot "
            f"hold ({_first_line(error)})"
        ) from None
    timings["torch.export"] = round(time.perf_counter() - start, 3)
    files = {}
    if "pt2" in options.formats:
        step("saving model.pt2")
        save_pt2(program, stage / PT2_FILE)
        files["pt2"] = PT2_FILE
    # the float32 projections in the native kernel's panels (attnexport.PackedMatMul), unless
    # the quantizer rewrites them next
    packed = options.weights is None and options.target == "attnexport"
    if "onnx" in options.formats:
        start = time.perf_counter()
        lowering.to_onnx(
            program,
            sample.args,
            stage / ONNX_FILE,
            target=options.target,
            cache_spec=cache_spec,
            metadata={"architecture": model.zoo_name, "kind": model.kind, "impl": model.impl},
            prefill_attention=options.prefill_attention,
            pack_float_weights=packed,
            lossless_weights=packed and options.lossless_weights,
            step=lambda description: step(f"ONNX ({options.target}): {description}"),
        )
        timings["onnx"] = round(time.perf_counter() - start, 3)
        files["onnx"] = ONNX_FILE
    return {
        "dtype": dtype_name(options.dtype),
        "kv_cache_dtype": dtype_name(kv_cache_dtype or options.dtype),
        "config": model.config.to_dict(),
        "cache": cache_entry(cache_spec),
        "target": options.target if "onnx" in options.formats else None,
        "prefill_attention": options.prefill_attention if "onnx" in options.formats else None,
        "lossless_weights": packed and options.lossless_weights and "onnx" in options.formats,
        "files": files,
        "file_digests": {},  # once every file is written
        "input_names": list(sample.input_names),
        "export_seconds": timings,
    }


def quantize_export(source: Path, out: Path, weights: WeightQuantization) -> dict:
    """Copies the float32 ONNX export ``source`` to the new directory ``out`` with its weights
    quantized as ``weights`` asks: what ``export --weights`` does after the lowering, without
    exporting again; staged and moved in when complete, as an export. Returns the new manifest
    (``weights`` recorded, digests renewed)."""
    from attnexport import lowering

    manifest = read_manifest(source)
    if manifest is None or manifest.get("files", {}).get("onnx") is None:
        raise ArtifactError(f"{source}: not an ONNX export (no manifest listing model.onnx)")
    if manifest.get("weights") is not None or manifest["dtype"] != "float32":
        raise ArtifactError(f"{source}: quantized exports are made from float32 weights")
    if out.exists():
        raise ArtifactError(f"--out: {out} exists")
    with staging_directory(out) as stage:
        shutil.copytree(source, stage, dirs_exist_ok=True)
        start = time.perf_counter()
        try:
            manifest["weights"] = lowering.quantize_weights(stage / ONNX_FILE, weights)
        except lowering.QuantizationError as error:
            raise ArtifactError(str(error)) from None
        manifest["export_seconds"] = {
            **manifest.get("export_seconds", {}),
            "quantize": round(time.perf_counter() - start, 3),
        }
        manifest["file_digests"] = model_file_digests(stage, manifest["files"])
        write_manifest(stage, manifest)
        publish(stage, out)
    return manifest


def _kv_cache_dtype(options: ExportOptions) -> torch.dtype | None:
    """The KV cache dtype of ``options`` (None: the model's), refused where it cannot run."""
    from attnexport.model_interface import KV_CACHE_DTYPES

    name = options.kv_cache_dtype
    if name not in KV_CACHE_DTYPES:
        raise ArtifactError(
            f"--kv-cache-dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"
        )
    if name == "auto" or name == dtype_name(options.dtype):
        return None
    if "onnx" in options.formats and options.target == "ort-cuda":
        raise ArtifactError(
            f"--kv-cache-dtype {name} with --target ort-cuda: com.microsoft.PagedAttention "
            "takes caches of the query's dtype; use --target attnexport"
        )
    return getattr(torch, name)


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value of the non-empty floating-point ``tensor`` is finite: its minimum and
    maximum are (a NaN is both); one reduction, ~4x faster than ``isfinite(t).all()`` and
    its boolean copy of the tensor."""
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_finite_weights(model: torch.nn.Module, model_ref: str) -> None:
    """Refuses a model with a NaN or infinite weight (ArtifactError naming the tensor): the
    export would run, and every output would be NaN."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.numel() and not _finite(tensor):
            raise ArtifactError(
                f"{model_ref}: weight {name!r} holds NaN or infinite values; fix the checkpoint"
            )
