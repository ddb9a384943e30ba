"""Export directories: file names, the manifest (read, validate, integrity), which model file
a path means, safe ``.pt2`` loading and rebuilding the eager model. The CLI and
``attnexport.runtime.loading`` both use this module (it imports neither).

An export directory holds ``model.onnx`` and/or ``model.pt2``, the tokenizer files of the
checkpoint (when it has them) and ``manifest.json`` (see :mod:`attnexport.cli.artifact` for its
keys). Since format version 2 the manifest's ``file_digests`` records the size and SHA-256 of
every model file it lists (``model.onnx``, its external data ``model.onnx.data`` when there is
one, ``model.pt2``); loading a file whose size or digest differs is an :class:`ArtifactError`.

``.pt2`` files are zip archives written by ``torch.export.save``; ``torch.export.load`` unpickles
several kinds of entries (weights and constants marked ``use_pickle``, torchbind and opaque
objects, and the sample inputs, which it retries with the full unpickler when the restricted one
fails) and loads AOTInductor shared libraries. :func:`load_pt2` inspects the archive first and
refuses every such entry (:class:`UnsafeArtifactError`) unless ``trust_pickle=True``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import zipfile
from pathlib import Path, PurePosixPath

import torch

from attnexport.errors import UserError

MANIFEST = "manifest.json"
ONNX_FILE = "model.onnx"
ONNX_DATA_FILE = f"{ONNX_FILE}.data"
PT2_FILE = "model.pt2"
MODEL_FILES = {"onnx": ONNX_FILE, "pt2": PT2_FILE}
"""The model file of each format; the manifest's ``files`` maps formats to these names."""
FORMAT = "attnexport-artifact"
FORMAT_VERSION = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = ("decoder", "encoder", "encoder-decoder")
EXECUTORS = ("auto", "ort", "torch")
EXECUTOR_FORMAT = {"ort": "onnx", "torch": "pt2"}


class ArtifactError(UserError):
    """An export directory or model file that cannot be used; the message names the file and
    says how to fix it."""


class UnsafeArtifactError(ArtifactError):
    """A ``.pt2`` archive with entries that loading would unpickle or execute."""


# ----------------------------------------------------------------------------- the manifest


def artifact_dir(path: str | os.PathLike) -> Path:
    """The export directory of ``path`` (itself, or the directory holding a model file)."""
    path = Path(path)
    return path if path.is_dir() else path.parent


def read_manifest(path: str | os.PathLike, *, plain_ok: bool = False) -> dict | None:
    """The validated manifest of an export directory or of the directory holding a model file;
    None when there is none.

    With ``plain_ok``, a JSON object without a ``format`` key (a hand-written manifest with,
    say, ``config.max_position_embeddings``, which the runtime reads) is returned as it is: it
    lists no model files, so the loaders treat the directory as one without a manifest.

    Raises:
        ArtifactError: ``manifest.json`` is not JSON, not an attnexport manifest, or a field
            has the wrong type (the message names the file and the field).
    """
    file = artifact_dir(path) / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(
            f"{file}: not valid JSON ({error}); re-export the model (attnexport export ... "
            "--overwrite)"
        ) from None
    if plain_ok and isinstance(manifest, dict) and "format" not in manifest:
        return manifest
    validate_manifest(manifest, file)
    return manifest


def is_export_manifest(manifest: dict | None) -> bool:
    """True for a manifest ``attnexport export`` wrote (not None, not a plain one)."""
    return manifest is not None and "format" in manifest


def _field_error(file: Path, name: str, expected: str, value) -> ArtifactError:
    return ArtifactError(f"{file}: field {name!r}: expected {expected}, got {value!r}")


def validate_manifest(manifest, file: Path) -> None:
    """Checks the keys the loaders read; ArtifactError naming ``file`` and the field."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{file}: not an attnexport manifest (no 'format': {FORMAT!r})")
    version = manifest.get("format_version")
    if version not in (1, FORMAT_VERSION):
        raise _field_error(file, "format_version", f"1 or {FORMAT_VERSION}", version)
    if manifest.get("kind") not in KINDS:
        raise _field_error(file, "kind", " or ".join(KINDS), manifest.get("kind"))
    if manifest.get("dtype") not in DTYPES:
        raise _field_error(file, "dtype", " or ".join(DTYPES), manifest.get("dtype"))
    files = manifest.get("files")
    if not isinstance(files, dict) or any(MODEL_FILES.get(k) != v for k, v in files.items()):
        raise _field_error(file, "files", f"a subset of {MODEL_FILES}", files)
    names = manifest.get("input_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _field_error(file, "input_names", "a list of strings", names)
    for key in ("vocab_size", "max_model_len"):
        value = manifest.get(key)
        if value is not None and (type(value) is not int or value < 1):
            raise _field_error(file, key, "a positive integer or null", value)
    cache = manifest.get("cache")
    if manifest["kind"] != "encoder":
        keys = ("block_size", "num_layers", "num_kv_heads", "head_size")
        if not isinstance(cache, dict) or not all(
            type(cache.get(k)) is int and cache[k] > 0 for k in keys
        ):
            raise _field_error(file, "cache", f"an object with positive {', '.join(keys)}", cache)
    source = manifest.get("source")
    if not isinstance(source, dict) or source.get("kind") not in ("zoo", "checkpoint"):
        raise _field_error(file, "source", "{'kind': 'zoo' | 'checkpoint', ...}", source)
    generation = manifest.get("generation", {})
    if not isinstance(generation, dict):
        raise _field_error(file, "generation", "an object", generation)
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
        path = directory / each
        if not path.is_file():
            raise ArtifactError(f"{path}: listed in {manifest_file} but missing; re-export")
        expected = manifest.get("file_digests", {}).get(each)
        if expected is None:
            continue  # format version 1: no digests recorded
        if path.stat().st_size != expected["bytes"] or file_digest(path) != expected:
            raise ArtifactError(
                f"{path}: size or SHA-256 differs from the one {manifest_file} records "
                "(the file was replaced or damaged after export); re-export the model"
            )
    return directory / name


def resolve_artifact(path: str | os.PathLike, executor: str = "auto") -> tuple[str, Path]:
    """(executor kind ``ort`` or ``torch``, verified model file) for ``path`` and the executor
    asked for.

    With a manifest, only the files it lists are candidates, and the chosen one is checked
    against its recorded size and SHA-256 (:func:`check_model_file`). ``auto`` takes onnxruntime
    for an ``.onnx`` file or a directory with ``model.onnx``, torch for a ``.pt2`` file or a
    directory with only ``model.pt2``.

    Raises:
        ArtifactError: the path does not exist, holds no usable model file, not the one
            ``executor`` needs, or a file the manifest does not list or whose digest differs.
    """
    if executor not in EXECUTORS:
        raise UserError(f"executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"artifact: {path} does not exist")
    manifest = read_manifest(path, plain_ok=True)
    if not is_export_manifest(manifest):
        manifest = None  # no list of model files: take the files present
    directory = artifact_dir(path)
    if path.is_dir():
        if manifest is not None:
            present = [k for k, f in EXECUTOR_FORMAT.items() if f in manifest["files"]]
        else:
            present = [k for k, f in EXECUTOR_FORMAT.items() if (path / MODEL_FILES[f]).is_file()]
        if not present:
            raise ArtifactError(
                f"artifact: {path} holds neither {ONNX_FILE} nor {PT2_FILE}; "
                "export a model there first (attnexport export MODEL --out DIR)"
            )
        kind = present[0] if executor == "auto" else executor
        if kind not in present:
            wanted = MODEL_FILES[EXECUTOR_FORMAT[kind]]
            raise ArtifactError(
                f"artifact: {path} has no {wanted} for --executor {kind}; "
                f"re-export with --format {EXECUTOR_FORMAT[kind]} or both"
            )
    else:
        kind = {".onnx": "ort", ".pt2": "torch"}.get(path.suffix)
        if kind is None:
            raise ArtifactError(
                f"artifact: expected a .onnx or .pt2 file or an export directory: {path}"
            )
        if executor not in ("auto", kind):
            raise ArtifactError(
                f"artifact: {path.name} runs on the {kind} executor, not {executor}"
            )
        if manifest is not None and path.name not in manifest["files"].values():
            raise ArtifactError(
                f"artifact: {path} is not a model file {directory / MANIFEST} lists "
                f"({sorted(manifest['files'].values())}); only listed files are loaded"
            )
    if manifest is None:
        return kind, path if path.is_file() else path / MODEL_FILES[EXECUTOR_FORMAT[kind]]
    return kind, check_model_file(manifest, directory, EXECUTOR_FORMAT[kind])


# ----------------------------------------------------------------------------- safe .pt2 loading


def _pt2_constants():
    from torch.export.pt2_archive import constants

    return constants


def _trust_hint(path: Path) -> str:
    return (
        f"refusing to load {path}: only load a .pt2 you trust with --trust-remote-pickle "
        "(Python: trust_pickle=True), or re-export it with attnexport"
    )


def _restricted_unpickle(data: bytes, path: Path, entry: str) -> None:
    """Reads ``data`` with torch's ``weights_only`` unpickler (it builds tensors and plain
    containers and calls nothing else); UnsafeArtifactError when that unpickler refuses it."""
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as error:  # any refusal means the full unpickler would be needed
        raise UnsafeArtifactError(
            f"{path}: entry {entry} needs the full unpickler, which can run code "
            f"({type(error).__name__}); {_trust_hint(path)}"
        ) from None


def inspect_pt2(path: Path) -> None:
    """Refuses a ``.pt2`` archive that ``torch.export.load`` would unpickle or execute code from.

    Every entry must be one ``torch.export.save`` writes for an exported program; weights and
    constants must be raw tensor bytes (``use_pickle: false``, no torchbind or opaque objects);
    AOTInductor libraries and unknown entries are refused. The pickles that older archives
    hold (the sample inputs, torch < 2.9's ``data/weights/model.pt``) are accepted only when
    torch's restricted ``weights_only`` unpickler reads them; archives attnexport writes with
    torch >= 2.9 hold no pickle at all.

    Raises:
        ArtifactError: not a zip archive or not a torch.export archive.
        UnsafeArtifactError: an entry would be unpickled or executed.
    """
    c = _pt2_constants()
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as error:
        raise ArtifactError(f"{path}: not a .pt2 archive ({error}); re-export the model") from None
    with archive:
        names = archive.namelist()
        if len(set(names)) != len(names):
            raise UnsafeArtifactError(f"{path}: duplicate archive entries; {_trust_hint(path)}")
        roots = {PurePosixPath(n).parts[0] for n in names if n}
        if len(roots) != 1:
            raise ArtifactError(f"{path}: not a torch.export archive (entries under {roots})")
        root = roots.pop()
        entries = {n[len(root) + 1 :]: n for n in names}
        if c.ARCHIVE_VERSION_PATH not in entries or not any(
            e.startswith(c.MODELS_DIR) for e in entries
        ):
            raise ArtifactError(f"{path}: not a torch.export archive (no archive_version/models)")
        allowed_prefixes = (
            c.MODELS_DIR,
            c.WEIGHTS_DIR,
            c.CONSTANTS_DIR,
            c.SAMPLE_INPUTS_DIR,
            c.EXTRA_DIR,
            ".data/",
        )
        allowed_files = (c.ARCHIVE_FORMAT_PATH, c.ARCHIVE_VERSION_PATH, "byteorder")
        for entry in entries:
            if entry.endswith("/") or entry in allowed_files:
                continue
            if not entry.startswith(allowed_prefixes) or ".." in PurePosixPath(entry).parts:
                raise UnsafeArtifactError(
                    f"{path}: entry {entry!r} is not part of an exported program (AOTInductor "
                    f"libraries and other payloads are never loaded); {_trust_hint(path)}"
                )
        models = [
            e[len(c.MODELS_DIR) : -len(".json")]
            for e in entries
            if e.startswith(c.MODELS_DIR) and e.endswith(".json")
        ]
        for model in models:
            for directory, kind in ((c.WEIGHTS_DIR, "weights"), (c.CONSTANTS_DIR, "constants")):
                legacy = f"{directory}{model}.pt"
                config = f"{directory}{model}_{kind}_config.json"
                if legacy in entries:
                    _restricted_unpickle(archive.read(entries[legacy]), path, legacy)
                if config in entries:
                    _check_payload_config(archive.read(entries[config]), path, config, c)
            sample = c.SAMPLE_INPUTS_FILENAME_FORMAT.format(model)
            if sample in entries and archive.getinfo(entries[sample]).file_size:
                _restricted_unpickle(archive.read(entries[sample]), path, sample)


def _check_payload_config(data: bytes, path: Path, entry: str, c) -> None:
    """Every weight/constant of a payload config must be raw tensor bytes."""
    try:
        config = json.loads(data)["config"]
        items = config.items()
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise ArtifactError(f"{path}: {entry} is not a payload config; re-export") from None
    for fqn, meta in items:
        name = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(name, str) or (
            "constants" in entry and not name.startswith(c.TENSOR_CONSTANT_FILENAME_PREFIX)
        ):
            raise UnsafeArtifactError(
                f"{path}: {entry} stores {fqn!r} as an object ({name!r}), which loading "
                f"unpickles; {_trust_hint(path)}"
            )
        if meta.get("use_pickle") is not False:
            raise UnsafeArtifactError(
                f"{path}: {entry} marks {fqn!r} as pickled (use_pickle); {_trust_hint(path)}"
            )


def load_pt2(
    path: str | os.PathLike, *, trust_pickle: bool = False
) -> torch.export.ExportedProgram:
    """``torch.export.load(path)`` after :func:`inspect_pt2` (skipped with ``trust_pickle``).

    Raises:
        ArtifactError: not a loadable ``.pt2`` (the message names the file).
        UnsafeArtifactError: the archive would run code when loaded and ``trust_pickle`` is
            False.
    """
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such .pt2 file")
    if not trust_pickle:
        inspect_pt2(path)
    try:
        return torch.export.load(path)
    except Exception as error:  # the file's content is the user's: any failure here is its
        raise ArtifactError(
            f"{path}: cannot be loaded by torch.export.load ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); re-export the model"
        ) from error


def save_pt2(program: torch.export.ExportedProgram, path: Path) -> None:
    """``torch.export.save`` without the sample inputs, the one entry torch would otherwise
    pickle (the loaders never need them)."""
    example_inputs = program._example_inputs
    program._example_inputs = None
    try:
        torch.export.save(program, path)
    finally:
        program._example_inputs = example_inputs


# ----------------------------------------------------------------------------- the eager model


def rebuild_eager_model(manifest: dict):
    """The eager model an artifact was exported from (zoo name + seed, or the checkpoint
    directory if it still exists); None when the checkpoint is gone."""
    from attnexport.models.registry import load_checkpoint, load_zoo_model

    source = manifest["source"]
    dtype = DTYPES[manifest["dtype"]]
    if source["kind"] == "zoo":
        return load_zoo_model(source["name"], dtype=dtype, seed=source.get("seed", 0))
    if Path(source["path"]).is_dir():
        return load_checkpoint(source["path"], dtype=dtype)
    return None
