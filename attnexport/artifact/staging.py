"""An export is all there or not there: it is written into a staging directory inside its
target and moved in, file by file, only when complete; no torch.

``attnexport export ... --out DIR`` writes every file into ``DIR/.attnexport-partial-XXXXXXXX``.
When the export is complete, the files of an earlier export that the new one does not have are
removed (its manifest first), the new files replace theirs and the new manifest comes last:
renames within one directory, with SIGINT, SIGTERM and SIGHUP held off until they are done.
An export that fails or is interrupted before that point (an error, Ctrl-C, SIGTERM, a full
disk) removes the staging directory, and the directory it created, so the target is as it
was: absent, or the earlier export intact. Only a SIGKILL or a power loss can leave the
staging directory behind (delete it), or, during the final renames, a directory without a
manifest, which the loaders refuse (:class:`IncompleteArtifactError`).

A full disk (``ENOSPC``, ``EDQUOT``) or the file size limit (``EFBIG``: Python ignores
``SIGXFSZ``) is an :class:`ArtifactError`, a one-line error of the CLI.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

from attnexport.artifact.errors import ArtifactError
from attnexport.artifact.files import EXPORT_FILES, MANIFEST, TOKENIZER_FILES
from attnexport.artifact.manifest import read_manifest
from attnexport.errors import UserError

STAGING_PREFIX = ".attnexport-partial-"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errors of a write that found no room: no space, no quota, over the file size limit."""
HELD_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def earlier_export(out: Path, *, overwrite: bool) -> list[Path]:
    """The files of an earlier export in ``out`` (its manifest and model files); refuses them
    unless ``overwrite``. Called before anything is loaded, so a refusal costs nothing."""
    if out.exists() and not out.is_dir():
        raise ArtifactError(f"--out: {out} exists and is not a directory")
    earlier = [out / n for n in EXPORT_FILES]
    earlier = [p for p in earlier if os.path.lexists(p)]
    if earlier and not overwrite:
        raise ArtifactError(
            f"--out: {out} holds an earlier export ({', '.join(p.name for p in earlier)}); "
            "pass --overwrite to replace it, or choose another directory"
        )
    return earlier


@contextlib.contextmanager
def staging_directory(out: Path) -> Iterator[Path]:
    """A new, empty staging directory inside ``out`` (created, with its parents, when
    missing) to write an export into and :func:`publish` from. When the block raises, the
    staging directory is removed, and ``out`` too when this call created it; a full disk
    becomes an ArtifactError."""
    created = not out.exists()
    stage = out / f"{STAGING_PREFIX}{secrets.token_hex(4)}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage.mkdir()
        yield stage
    except BaseException as error:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                out.rmdir()  # only when empty: what publish moved in stays
        full = disk_full(error)
        if full is None:
            raise
        raise ArtifactError(
            f"--out: {full.strerror or os.strerror(full.errno)} while writing the export "
            f"into {out}; nothing was changed there: free some space (or raise the file size "
            "limit) and export again"
        ) from None


def disk_full(error: BaseException | None) -> OSError | None:
    """The OSError of a full disk or file size limit in ``error`` or the errors it was raised
    from (a writer may wrap it); None when there is none."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in DISK_FULL:
            return error
        error = error.__cause__ or error.__context__
    return None


def publish(stage: Path, out: Path) -> None:
    """Moves the complete export in ``stage`` into ``out``: the files of an earlier export
    that it does not have are removed (the manifest first), its files replace theirs, its
    manifest comes last; SIGINT, SIGTERM and SIGHUP wait until this is done. Files of ``out``
    that no export wrote are kept.

    Raises:
        ArtifactError: a name the export writes is a directory in ``out`` (checked before
            anything is moved).
    """
    new = sorted(p.name for p in stage.iterdir() if p.name != MANIFEST)
    stale = sorted(set(_earlier_export_names(out)) - {*new, MANIFEST})
    for name in [*new, *stale, MANIFEST]:
        try:
            mode = os.lstat(out / name).st_mode
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(mode):
            raise ArtifactError(f"--out: {out / name} is a directory; remove it and export again")
    with _signals_held():
        for name in [MANIFEST, *stale]:
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
        for name in [*new, MANIFEST]:
            os.replace(stage / name, out / name)
        stage.rmdir()


def _earlier_export_names(out: Path) -> list[str]:
    """The files of the earlier export in ``out``: its manifest, model files and the tokenizer
    files it copied (every name an export copies when its manifest is missing or damaged)."""
    try:
        manifest = read_manifest(out)
    except UserError:  # damaged, a link, or model files without a manifest
        manifest = None
    copied = (
        TOKENIZER_FILES
        if manifest is None
        else [*(manifest.get("tokenizer_files") or []), "generation_config.json"]
    )
    return [n for n in {*EXPORT_FILES, *copied} if os.path.lexists(out / n)]


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Holds SIGINT, SIGTERM and SIGHUP back (delivered when the block ends), where the
    platform can."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = {getattr(signal, name) for name in HELD_SIGNALS if hasattr(signal, name)}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
