"""Safe ``.pt2`` loading and saving.

``.pt2`` files are zip archives written by ``torch.export.save``; ``torch.export.load`` unpickles
several kinds of entries (weights and constants marked ``use_pickle``, torchbind and opaque
objects, and the sample inputs, which it retries with the full unpickler when the restricted one
fails) and loads AOTInductor shared libraries. :func:`load_pt2` inspects the archive first and
refuses every such entry (:class:`UnsafeArtifactError`) unless ``trust_pickle=True``.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path, PurePosixPath

import torch

from attnexport.artifact.errors import ArtifactError, UnsafeArtifactError


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
    pickle (the loaders never need them).

    Raises:
        OSError: a write failed (a full disk, the file size limit), as Python raised it.
    """
    example_inputs = program._example_inputs
    program._example_inputs = None
    try:
        with path.open("wb") as handle:
            sink = _FirstWriteError(handle)
            torch.export.save(program, sink)
        if sink.error is not None:
            raise sink.error
    finally:
        program._example_inputs = example_inputs


class _FirstWriteError(io.RawIOBase):
    """A file for torch's archive writer that keeps the first failed write's OSError and
    swallows the writes after it. torch turns a failed write into a RuntimeError and then,
    in the writer's destructor, into a C++ exception that aborts the process; with every write
    succeeding the archive is finished (unusable) and the OSError raised after."""

    def __init__(self, handle) -> None:
        super().__init__()
        self.handle = handle
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = len(memoryview(data))
        if self.error is None:
            try:
                self.handle.write(data)
            except OSError as error:
                self.error = error
        return size

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return offset if self.error is not None else self.handle.seek(offset, whence)

    def flush(self) -> None:
        if self.error is None:
            try:
                self.handle.flush()
            except OSError as error:
                self.error = error
