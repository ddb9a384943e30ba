"""``manifest.json``: building, writing, reading and validating it, and the integrity of the
model files it lists; no torch.

``attnexport export`` writes::

    {
      "format": "attnexport-artifact", "format_version": 2,
      "architecture": "llama", "kind": "decoder", "impl": "zoo",
      "source": {"kind": "zoo", "name": "llama", "seed": 0} | {"kind": "checkpoint", "path": ...},
      "dtype": "float32", "kv_cache_dtype": "float32", "config": {...the zoo config...},
      "cache": {"block_size": 16, "num_layers": 2, "num_cross_layers": 0, "num_kv_heads": 2,
                "head_size": 16, "dtype": "float32",
                "layout": "num_blocks,block_size,num_kv_heads,head_size"} | null,
      "target": "attnexport", "files": {"onnx": "model.onnx", "pt2": "model.pt2"},
      "weights": {"format": "int4", "bits": 4, "block_size": 32, "symmetric": true,
                  "accuracy_level": 4, "quantized_layers": 49, "float_layers": []},
      "file_digests": {"model.onnx": {"bytes": 123456, "sha256": "9f2c..."}, ...},
      "input_names": [...], "vocab_size": 256, "max_model_len": 2048,
      "rope_switch_length": null,
      "generation": {"eos_token_ids": [2], "decoder_start_token_id": null,
                     "forced_bos_token_id": null, "forced_eos_token_id": null},
      "tokenizer_files": ["tokenizer.json", ...],
      "versions": {"attnexport": ..., "torch": ..., "onnx": ..., "onnxruntime": ..., ...},
      "export_seconds": {"torch.export": 0.5, "onnx": 3.1}
    }

``kv_cache_dtype`` (optional; absent = ``dtype``, as in manifests written before it existed)
is the KV caches' dtype (``export --kv-cache-dtype``): ``float32``, ``bfloat16``, ``float16``
or ``int8`` (with float32 scale caches); ``cache.dtype`` repeats it.

``impl`` (optional; absent = ``zoo``, as in manifests written before it existed): how the
checkpoint was loaded, ``zoo`` (the zoo's network) or ``transformers`` (transformers' model
with its attention on the paged ops); ``impl_note`` (optional) says why the zoo did not load it
when ``export --impl auto`` fell back to transformers.

``rope_switch_length`` (optional; absent or null = none): a LongRoPE model's
``original_max_position_embeddings``, past which the engine recomputes a sequence (the
``.onnx`` also records it in its graph contract; a ``.pt2`` has only the manifest).

``weights`` (optional; absent = float weights) records the weight-only quantization of the
ONNX model (``export --weights int4|int8``, :mod:`attnexport.lowering.quantize`).

Since format version 2 ``file_digests`` records the size and SHA-256 of every model file it
lists (``model.onnx``, its external data ``model.onnx.data`` when there is one, ``model.pt2``);
loading a file whose size or digest differs is an :class:`ArtifactError`.

Every file is read through :mod:`attnexport.contained_files`: a manifest or model file that is
a symbolic link, or not a regular file, is refused (:class:`UnsafePathError`); so is a
directory that holds a model file but no manifest (:class:`IncompleteArtifactError`: an export
writes its manifest last).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from attnexport.artifact.errors import ArtifactError, IncompleteArtifactError
from attnexport.artifact.files import (
    MANIFEST,
    MODEL_FILES,
    ONNX_DATA_FILE,
    TOKENIZER_FILES,
    artifact_dir,
)
from attnexport.artifact.onnx_data import check_external_data, ort_checks_external_data
from attnexport.contained_files import contained_file, read_json
from attnexport.paged_inputs import MAX_SEQUENCE_LENGTH

FORMAT = "attnexport-artifact"
FORMAT_VERSION = 2
DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The model dtypes an export is made in (``attnexport export --dtype``)."""
KINDS = ("decoder", "encoder", "encoder-decoder")
IMPLS = ("zoo", "transformers")
"""How an export loaded its model (the manifest's ``impl``)."""
SOURCE_KINDS = ("zoo", "checkpoint")
CACHE_LAYOUT = "num_blocks,block_size,num_kv_heads,head_size"
GENERATION_TOKENS = (
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
)
"""Single-token generation defaults recorded in the manifest (``attnexport run`` uses them)."""
MAX_MANIFEST_BYTES = 16 << 20
"""The largest ``manifest.json`` read (an export writes a few kilobytes)."""
REEXPORT = "; re-export the model (attnexport export ... --overwrite)"


# ----------------------------------------------------------------------------- reading


def read_manifest(path: str | os.PathLike, *, plain_ok: bool = False) -> dict | None:
    """The validated manifest of an export directory or of the directory holding a model file;
    None when there is none.

    With ``plain_ok``, a JSON object without a ``format`` key (a hand-written manifest with,
    say, ``config.max_position_embeddings``, which the runtime reads) is returned as it is: it
    lists no model files, so the loaders take the ones present.

    Raises:
        ArtifactError: ``manifest.json`` is not JSON, not an attnexport manifest, or a field
            has the wrong type (the message names the file and the field).
        IncompleteArtifactError: ``path`` is a directory holding a model file but no manifest.
        UnsafePathError: ``manifest.json`` is a symbolic link or not a regular file.
    """
    path = Path(path)
    file = contained_file(artifact_dir(path), MANIFEST)
    if not file.is_file():
        if path.is_dir():
            refuse_model_without_manifest(path)
        return None
    manifest = read_json(file, ArtifactError, max_bytes=MAX_MANIFEST_BYTES, hint=REEXPORT)
    if plain_ok and isinstance(manifest, dict) and "format" not in manifest:
        return manifest
    validate_manifest(manifest, file)
    return manifest


def refuse_model_without_manifest(directory: Path) -> None:
    """IncompleteArtifactError when ``directory`` holds a model file (``model.onnx``, its
    external data, ``model.pt2``) but no manifest."""
    names = [n for n in (*MODEL_FILES.values(), ONNX_DATA_FILE) if os.path.lexists(directory / n)]
    if names and not os.path.lexists(directory / MANIFEST):
        raise IncompleteArtifactError(
            f"artifact: {directory} holds {', '.join(names)} but no {MANIFEST}: an interrupted "
            "or unfinished export (an export writes its manifest last); export it again "
            "(attnexport export MODEL --out DIR --overwrite)"
        )


def is_export_manifest(manifest: dict | None) -> bool:
    """True for a manifest ``attnexport export`` wrote (not None, not a plain one)."""
    return manifest is not None and "format" in manifest


def _field_error(file: Path, name: str, expected: str, value) -> ArtifactError:
    return ArtifactError(f"{file}: field {name!r}: expected {expected}, got {value!r}")


POSITION_KEYS = ("max_position_embeddings", "n_positions")
"""The model config keys that give its trained positions (Llama family and most others;
GPT-2)."""


def manifest_max_model_len(manifest: dict, file: Path) -> int | None:
    """The longest sequence a manifest declares: ``max_model_len``, else the positions of its
    ``config`` (:data:`POSITION_KEYS`); None when it declares neither as an int.

    Raises:
        ArtifactError: ``max_model_len`` is longer than the config's positions (the model has
            no embedding, or no training, for the positions past them) or than an int32.
    """
    config = manifest.get("config")
    config = config if isinstance(config, dict) else {}
    key = next((k for k in POSITION_KEYS if type(config.get(k)) is int), None)
    positions = config[key] if key is not None else None
    declared = manifest.get("max_model_len")
    if type(declared) is not int:
        return positions
    if positions is not None and declared > positions:
        raise ArtifactError(
            f"{file}: field 'max_model_len': {declared} is longer than the model's "
            f"{positions} positions (config.{key}); expected at most {positions}"
        )
    if declared > MAX_SEQUENCE_LENGTH:
        raise ArtifactError(
            f"{file}: field 'max_model_len': {declared} is longer than any sequence can be "
            f"(sequence lengths are int32); expected at most {MAX_SEQUENCE_LENGTH}"
        )
    return declared


def validate_manifest(manifest, file: Path) -> None:
    """Checks the keys the loaders read; ArtifactError naming ``file`` and the field."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{file}: not an attnexport manifest (no 'format': {FORMAT!r})")
    version = manifest.get("format_version")
    if version not in (1, FORMAT_VERSION):
        raise _field_error(file, "format_version", f"1 or {FORMAT_VERSION}", version)
    if manifest.get("kind") not in KINDS:
        raise _field_error(file, "kind", " or ".join(KINDS), manifest.get("kind"))
    if manifest.get("impl", "zoo") not in IMPLS:
        raise _field_error(file, "impl", " or ".join(IMPLS), manifest.get("impl"))
    if manifest.get("dtype") not in DTYPE_NAMES:
        raise _field_error(file, "dtype", " or ".join(DTYPE_NAMES), manifest.get("dtype"))
    cache_dtypes = (*DTYPE_NAMES, "int8")
    if manifest.get("kv_cache_dtype", manifest["dtype"]) not in cache_dtypes:
        raise _field_error(
            file, "kv_cache_dtype", " or ".join(cache_dtypes), manifest.get("kv_cache_dtype")
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or any(MODEL_FILES.get(k) != v for k, v in files.items()):
        raise _field_error(file, "files", f"a subset of {MODEL_FILES}", files)
    names = manifest.get("input_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _field_error(file, "input_names", "a list of strings", names)
    for key in ("vocab_size", "max_model_len", "rope_switch_length"):
        value = manifest.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise _field_error(file, key, "a positive integer or null", value)
    manifest_max_model_len(manifest, file)
    cache = manifest.get("cache")
    if manifest["kind"] != "encoder":
        keys = ("block_size", "num_layers", "num_kv_heads", "head_size")
        if not isinstance(cache, dict) or not all(
            type(cache.get(k)) is int and cache[k] > 0 for k in keys
        ):
            raise _field_error(file, "cache", f"an object with positive {', '.join(keys)}", cache)
    source = manifest.get("source")
    if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
        raise _field_error(file, "source", "{'kind': 'zoo' | 'checkpoint', ...}", source)
    weights = manifest.get("weights")
    if weights is not None and not (
        isinstance(weights, dict)
        and isinstance(weights.get("format"), str)
        and type(weights.get("bits")) is int
        and type(weights.get("block_size")) is int
        and isinstance(weights.get("float_layers", []), list)
    ):
        raise _field_error(
            file, "weights", "{format, bits, block_size, ...} or absent (float)", weights
        )
    embedding = manifest.get("embedding")
    if embedding is not None and not (
        isinstance(embedding, dict)
        and embedding.get("pooling") in ("mean", "cls")
        and isinstance(embedding.get("normalize"), bool)
        and (
            embedding.get("max_seq_length") is None
            or (type(embedding["max_seq_length"]) is int and embedding["max_seq_length"] > 0)
        )
    ):
        raise _field_error(
            file,
            "embedding",
            "{pooling: mean | cls, normalize, max_seq_length} or absent",
            embedding,
        )
    _validate_generation(manifest, file)
    names = manifest.get("tokenizer_files", [])
    if not isinstance(names, list) or not all(n in TOKENIZER_FILES for n in names):
        raise _field_error(file, "tokenizer_files", f"names among {TOKENIZER_FILES}", names)
    if version >= 2:
        digests = manifest.get("file_digests")
        if not isinstance(digests, dict) or not set(files.values()) <= set(digests):
            raise _field_error(file, "file_digests", "the size and sha256 of each file", digests)
        for name, digest in digests.items():
            if name not in (*MODEL_FILES.values(), ONNX_DATA_FILE) or not (
                isinstance(digest, dict)
                and type(digest.get("bytes")) is int
                and isinstance(digest.get("sha256"), str)
            ):
                raise _field_error(file, f"file_digests.{name}", "{bytes, sha256}", digest)


def _is_token(value, vocab_size: int | None) -> bool:
    return type(value) is int and value >= 0 and (vocab_size is None or value < vocab_size)


def _validate_generation(manifest: dict, file: Path) -> None:
    """The generation defaults every request takes: token ids of the vocabulary (a bad one
    would make the engine refuse every request, so it is refused here, at load)."""
    generation = manifest.get("generation", {})
    if not isinstance(generation, dict):
        raise _field_error(file, "generation", "an object", generation)
    vocab = manifest.get("vocab_size")
    ids = f"token ids in [0, {vocab})" if vocab else "token ids >= 0"
    eos = generation.get("eos_token_ids", [])
    if not isinstance(eos, list) or not all(_is_token(t, vocab) for t in eos):
        raise _field_error(file, "generation.eos_token_ids", f"a list of {ids}", eos)
    for key in GENERATION_TOKENS:
        value = generation.get(key)
        if value is not None and not _is_token(value, vocab):
            raise _field_error(file, f"generation.{key}", f"null or one of the {ids}", value)


# ----------------------------------------------------------------------------- integrity


def file_digest(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex digest}`` of a file, read in chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:  # hashlib.file_digest is Python >= 3.11; we support 3.10
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def model_file_digests(directory: Path, files: dict[str, str]) -> dict[str, dict]:
    """The ``file_digests`` manifest entry for the model files ``files`` of ``directory`` (and
    ``model.onnx.data`` when the ONNX weights went to external data)."""
    names = list(files.values())
    if "onnx" in files and (directory / ONNX_DATA_FILE).is_file():
        names.append(ONNX_DATA_FILE)
    return {name: file_digest(directory / name) for name in names}


def check_model_file(manifest: dict, directory: Path, fmt: str) -> Path:
    """The file of format ``fmt`` (``onnx`` or ``pt2``) that ``manifest`` lists, after checking
    its size and SHA-256 against the manifest (format version 2).

    Raises:
        ArtifactError: the manifest does not list a ``fmt`` file, it is missing, or its size or
            digest differs from the recorded one (another model's file, or a damaged copy).
    """
    manifest_file = directory / MANIFEST
    name = manifest["files"].get(fmt)
    if name is None:
        raise ArtifactError(
            f"{manifest_file}: this export has no {MODEL_FILES[fmt]} (files: "
            f"{sorted(manifest['files'].values())}); re-export with --format {fmt} or both"
        )
    names = [name]
    if fmt == "onnx" and ONNX_DATA_FILE in manifest.get("file_digests", {}):
        names.append(ONNX_DATA_FILE)
    for each in names:
        path = contained_file(directory, each)
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {manifest_file} but missing; re-export")
        require_model_bytes(path)
        expected = manifest.get("file_digests", {}).get(each)
        if expected is None:
            continue  # format version 1: no digests recorded
        if path.stat().st_size != expected["bytes"] or file_digest(path) != expected:
            raise ArtifactError(
                f"{path}: size or SHA-256 differs from the one {manifest_file} records "
                "(the file was replaced or damaged after export); re-export the model"
            )
    if fmt == "onnx" and not ort_checks_external_data():
        check_external_data(directory / name)
    return directory / name


def require_model_bytes(path: Path) -> None:
    """ArtifactError when the model file ``path`` is empty (no model has 0 bytes; onnxruntime
    would report a protobuf without a graph)."""
    if path.stat().st_size == 0:
        raise ArtifactError(f"{path}: empty (0 bytes), not a model{REEXPORT}")


# ----------------------------------------------------------------------------- writing


def dtype_name(dtype) -> str:
    """``torch.float32`` -> ``"float32"``: the manifest's spelling of a torch dtype."""
    return str(dtype).removeprefix("torch.")


def kv_cache_dtype(manifest: dict) -> str:
    """The KV caches' dtype name of a manifest (``dtype`` when it has no ``kv_cache_dtype``)."""
    return manifest.get("kv_cache_dtype") or manifest["dtype"]


def cache_entry(cache_spec) -> dict | None:
    """The manifest's ``cache``: a :class:`~attnexport.model_interface.CacheSpec` as JSON
    (None for an encoder, which has no cache)."""
    if cache_spec is None:
        return None
    return {
        "block_size": cache_spec.block_size,
        "num_layers": cache_spec.num_layers,
        "num_cross_layers": cache_spec.num_cross_layers,
        "num_kv_heads": cache_spec.num_kv_heads,
        "head_size": cache_spec.head_size,
        "dtype": dtype_name(cache_spec.dtype),
        "layout": CACHE_LAYOUT,
    }


def _token_ids(value, path: Path, key: str, vocab_size: int | None) -> list[int]:
    """The token ids of a checkpoint's ``key`` (one id or a list of ids); ArtifactError naming
    the file and the key for anything else, or an id outside the model's vocabulary."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_token(v, vocab_size) for v in values):
        ids = f"token ids in [0, {vocab_size})" if vocab_size else "token ids >= 0"
        raise ArtifactError(f"{path}: field {key!r}: expected {ids} or null, got {value!r}")
    return values


def _single_token(values: dict, key: str, path: Path, vocab_size: int | None) -> int | None:
    if isinstance(values[key], list):
        raise ArtifactError(f"{path}: field {key!r}: expected one token id or null")
    return (_token_ids(values[key], path, key, vocab_size) or [None])[0]


def generation_defaults(source: Path | None, model) -> dict:
    """End-of-sequence tokens, decoder start and forced first/last tokens, as
    ``transformers.generate`` would take them: ``generation_config.json`` first, then
    ``config.json``. A zoo model has its config's decoder start token and nothing else.

    End tokens past the model's vocabulary are left out (none can be generated).

    Raises:
        ArtifactError: a value that is not a token id, or (but for end tokens) one outside the
            model's vocabulary (every request would be refused), naming the file and the key.
        UnsafePathError: one of the files is a link out of the checkpoint.
    """
    config = getattr(model, "config", None)
    vocab_size = getattr(config, "vocab_size", None)
    defaults = {"eos_token_ids": [], **dict.fromkeys(GENERATION_TOKENS)}
    defaults["decoder_start_token_id"] = getattr(config, "decoder_start_token_id", None)
    if source is None:
        return defaults
    bos = None
    for name in ("config.json", "generation_config.json"):  # the later file wins
        path = contained_file(source, name, hub_links=True)
        if not path.is_file():
            continue
        values = read_json(path, ArtifactError)
        if not isinstance(values, dict):
            raise ArtifactError(f"{path}: expected a JSON object")
        if "eos_token_id" in values:
            # An end token past the vocabulary can never be generated: left out, as it changes
            # nothing (checkpoints shrunk from a family's defaults keep its end tokens).
            eos = _token_ids(values["eos_token_id"], path, "eos_token_id", None)
            defaults["eos_token_ids"] = [
                t for t in dict.fromkeys(eos) if vocab_size is None or t < vocab_size
            ]
        for key in GENERATION_TOKENS:
            if key in values:
                defaults[key] = _single_token(values, key, path, vocab_size)
        if "bos_token_id" in values and model.kind == "encoder-decoder":
            bos = _single_token(values, "bos_token_id", path, vocab_size)
    if defaults["decoder_start_token_id"] is None and model.kind == "encoder-decoder":
        # transformers starts the decoder from the BOS token when no start token is set.
        defaults["decoder_start_token_id"] = bos
    return defaults


def library_versions() -> dict[str, str]:
    """The manifest's ``versions``: attnexport's and those of the libraries an export uses."""
    import onnx
    import onnxruntime
    import onnxscript
    import torch

    from attnexport._version import __version__

    return {
        "attnexport": __version__,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "onnxscript": onnxscript.__version__,
        "onnxruntime": onnxruntime.__version__,
        "python": platform.python_version(),
    }


def write_manifest(directory: Path, manifest: dict) -> None:
    """Validates ``manifest`` as :func:`read_manifest` will (so an export never writes one its
    loaders refuse) and writes it to ``directory / manifest.json``."""
    file = directory / MANIFEST
    validate_manifest(manifest, file)
    file.write_text(json.dumps(manifest, indent=2) + "\n")
