"""What ``attnexport export`` writes into an export directory. Reading it (file names, manifest
validation and integrity, safe ``.pt2`` loading) lives in :mod:`attnexport.artifact`.

An export directory holds ``model.onnx`` and/or ``model.pt2``, the tokenizer files of the
checkpoint (when it has them) and ``manifest.json``::

    {
      "format": "attnexport-artifact", "format_version": 2,
      "architecture": "llama", "kind": "decoder",
      "source": {"kind": "zoo", "name": "llama", "seed": 0} | {"kind": "checkpoint", "path": ...},
      "dtype": "float32", "config": {...the zoo config...},
      "cache": {"block_size": 16, "num_layers": 2, "num_cross_layers": 0, "num_kv_heads": 2,
                "head_size": 16, "dtype": "float32",
                "layout": "num_blocks,block_size,num_kv_heads,head_size"} | null,
      "target": "attnexport", "files": {"onnx": "model.onnx", "pt2": "model.pt2"},
      "file_digests": {"model.onnx": {"bytes": 123456, "sha256": "9f2c..."}, ...},
      "input_names": [...], "vocab_size": 256, "max_model_len": 2048,
      "generation": {"eos_token_ids": [2], "decoder_start_token_id": null,
                     "forced_bos_token_id": null, "forced_eos_token_id": null},
      "tokenizer_files": ["tokenizer.json", ...],
      "versions": {"attnexport": ..., "torch": ..., "onnx": ..., "onnxruntime": ..., ...},
      "export_seconds": {"torch.export": 0.5, "onnx": 3.1}
    }
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from attnexport._version import __version__
from attnexport.artifact import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    MODEL_FILES,
    ONNX_DATA_FILE,
    ONNX_FILE,
    PT2_FILE,
    ArtifactError,
    model_file_digests,
    read_manifest,
    save_pt2,
)

FORMATS = ("onnx", "pt2", "both")
# dtypes whose ONNX model onnxruntime's CPU provider cannot run (the attnexport and standard
# targets run there), with the reason; float16 runs (`verify` passes).
CPU_UNRUNNABLE = {
    torch.bfloat16: "onnxruntime's CPU provider has no bfloat16 kernels for the model's ops "
    "(e.g. Mul), so the exported model could not run",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class ExportOptions:
    """What ``attnexport export`` was asked for."""

    formats: tuple[str, ...] = ("onnx",)
    target: str = "attnexport"
    dtype: torch.dtype = torch.float32
    block_size: int = 16
    seed: int = 0
    overwrite: bool = False


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import onnxscript

    return {
        "attnexport": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


GENERATION_TOKENS = (
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
)
"""Single-token generation defaults recorded in the manifest (``attnexport run`` uses them)."""


def generation_defaults(source: Path | None, model) -> dict:
    """End-of-sequence tokens, decoder start and forced first/last tokens, as
    ``transformers.generate`` would take them: ``generation_config.json`` first, then
    ``config.json``. A zoo model has its config's decoder start token and nothing else."""
    config = getattr(model, "config", None)
    defaults = {"eos_token_ids": [], **dict.fromkeys(GENERATION_TOKENS)}
    defaults["decoder_start_token_id"] = getattr(config, "decoder_start_token_id", None)
    if source is None:
        return defaults
    bos = None
    for name in ("config.json", "generation_config.json"):  # the later file wins
        path = source / name
        if not path.is_file():
            continue
        values = json.loads(path.read_text())
        if "eos_token_id" in values:
            defaults["eos_token_ids"] = _as_list(values["eos_token_id"])
        bos = values.get("bos_token_id", bos)
        for key in GENERATION_TOKENS:
            if key in values:
                defaults[key] = None if values[key] is None else int(values[key])
    if defaults["decoder_start_token_id"] is None and model.kind == "encoder-decoder":
        # transformers starts the decoder from the BOS token when no start token is set.
        defaults["decoder_start_token_id"] = bos
    return defaults


def export_artifact(
    model_ref: str,
    out: Path,
    options: ExportOptions,
    *,
    step: Callable[[str], None] = lambda _: None,
) -> dict:
    """Exports zoo model or checkpoint ``model_ref`` into directory ``out``; returns the
    manifest. ``step(description)`` is called before each long step (for progress display)."""
    from attnexport import lowering
    from attnexport.models import load_checkpoint, load_zoo_model, resolve_model_ref

    if options.target not in ("attnexport", "standard", "ort-cuda"):
        raise ArtifactError(
            f"--target: expected attnexport, standard or ort-cuda, got {options.target!r}"
        )
    if options.block_size < 1:
        raise ArtifactError(f"--block-size: expected a positive integer, got {options.block_size}")
    if (
        "onnx" in options.formats
        and options.dtype in CPU_UNRUNNABLE
        and options.target != "ort-cuda"
    ):
        raise ArtifactError(
            f"--dtype {_dtype_name(options.dtype)} with ONNX: {CPU_UNRUNNABLE[options.dtype]}; "
            "export with --dtype float32 (or float16) for onnxruntime, --format pt2 to run "
            f"{_dtype_name(options.dtype)} with torch, or --target ort-cuda for onnxruntime's "
            "CUDA provider"
        )
    earlier = earlier_export(out, overwrite=options.overwrite)
    kind, ref = resolve_model_ref(model_ref)
    source = ref if kind == "checkpoint" else None
    step(f"loading {'checkpoint ' + str(ref) if source else 'zoo model ' + str(ref)}")
    model = (
        load_checkpoint(ref, dtype=options.dtype)
        if source
        else load_zoo_model(str(ref), dtype=options.dtype, seed=options.seed)
    )
    check_finite_weights(model, model_ref)
    if earlier:
        remove_earlier_export(out)
    out.mkdir(parents=True, exist_ok=True)

    sample = model.export_sample(options.block_size)
    cache_spec = model.cache_spec(options.block_size) if model.kind != "encoder" else None
    timings = {}
    step("torch.export")
    start = time.perf_counter()
    program = lowering.export_program(model, sample.args, dynamic_shapes=sample.dynamic_shapes)
    timings["torch.export"] = round(time.perf_counter() - start, 3)
    files = {}
    if "pt2" in options.formats:
        step("saving model.pt2")
        save_pt2(program, out / PT2_FILE)
        files["pt2"] = PT2_FILE
    if "onnx" in options.formats:
        step(f"lowering to ONNX (target {options.target})")
        start = time.perf_counter()
        lowering.to_onnx(
            program,
            sample.args,
            out / ONNX_FILE,
            target=options.target,
            cache_spec=cache_spec,
            metadata={"architecture": model.zoo_name, "kind": model.kind},
        )
        timings["onnx"] = round(time.perf_counter() - start, 3)
        files["onnx"] = ONNX_FILE

    tokenizer_files = []
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
                tokenizer_files.append(name)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": model.zoo_name,
        "kind": model.kind,
        "source": (
            {"kind": "checkpoint", "path": str(source.resolve())}
            if source is not None
            else {"kind": "zoo", "name": str(ref), "seed": options.seed}
        ),
        "dtype": _dtype_name(options.dtype),
        "config": model.config.to_dict(),
        "cache": None
        if cache_spec is None
        else {
            "block_size": cache_spec.block_size,
            "num_layers": cache_spec.num_layers,
            "num_cross_layers": cache_spec.num_cross_layers,
            "num_kv_heads": cache_spec.num_kv_heads,
            "head_size": cache_spec.head_size,
            "dtype": _dtype_name(cache_spec.dtype),
            "layout": "num_blocks,block_size,num_kv_heads,head_size",
        },
        "target": options.target if "onnx" in options.formats else None,
        "files": files,
        "file_digests": model_file_digests(out, files),
        "input_names": list(sample.input_names),
        "vocab_size": getattr(model.config, "vocab_size", None),
        "max_model_len": model.max_model_len,
        "generation": generation_defaults(source, model),
        "tokenizer_files": [n for n in tokenizer_files if n != "generation_config.json"],
        "versions": _versions(),
        "export_seconds": timings,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def check_finite_weights(model: torch.nn.Module, model_ref: str) -> None:
    """Refuses a model with a NaN or infinite weight (ArtifactError naming the tensor): the
    export would run, and every output would be NaN."""
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ArtifactError(
                f"{model_ref}: weight {name!r} holds NaN or infinite values; fix the checkpoint"
            )


def earlier_export(out: Path, *, overwrite: bool) -> list[Path]:
    """The files of an earlier export in ``out`` (its manifest and model files); refuses them
    unless ``overwrite``. Called before anything is loaded, so a refusal costs nothing."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out: {out} exists and is not a directory")
    earlier = [out / n for n in (MANIFEST, *MODEL_FILES.values(), ONNX_DATA_FILE)]
    earlier = [p for p in earlier if p.exists() or p.is_symlink()]
    if earlier and not overwrite:
        raise ArtifactError(
            f"--out: {out} holds an earlier export ({', '.join(p.name for p in earlier)}); "
            "pass --overwrite to replace it, or choose another directory"
        )
    return earlier


def remove_earlier_export(out: Path) -> None:
    """Removes the files of the earlier export in ``out``: its manifest, model files and the
    tokenizer files it copied (every name an export copies when its manifest is missing or
    damaged), so that none of them outlives it. Other files are kept."""
    try:
        manifest = read_manifest(out)
    except ArtifactError:
        manifest = None
    copied = (
        TOKENIZER_FILES
        if manifest is None
        else [*(manifest.get("tokenizer_files") or []), "generation_config.json"]
    )
    owned = (*TOKENIZER_FILES, MANIFEST, *MODEL_FILES.values(), ONNX_DATA_FILE)
    for name in {MANIFEST, *MODEL_FILES.values(), ONNX_DATA_FILE, *copied}:
        path = out / name
        if name in owned and (path.is_file() or path.is_symlink()):
            path.unlink()
