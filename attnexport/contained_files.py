"""The files a loader reads from a directory the user names (an export directory, a
checkpoint): only the directory's own regular files, never a symbolic link, a path out of it
or a special file. The one home of that check, for every layer (no import but
:mod:`attnexport.errors`).

A directory from an untrusted source could otherwise make a loader read any file of the
machine: a ``chat_template.jinja`` linked to ``/etc/passwd`` is rendered into every chat
prompt (and comes back through ``prompt_token_ids``); a checkpoint's linked
``tokenizer.json`` would be copied into the export made from it. A FIFO would hang the loader.

The directory itself may be a link (it is the path the user gave); what lies below it may not.
One layout is accepted where it is asked for (``hub_links``): a Hugging Face hub cache
snapshot, ``<repo>/snapshots/<revision>/``, whose files are links into ``<repo>/blobs/``: a
link there may lead, in one step, to a regular file of that ``blobs`` directory and nowhere
else.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePath

from attnexport.errors import UserError

RULE = "only a directory's own regular files are read, never a link or a path out of it"


class UnsafePathError(UserError):
    """A file a loader would open that is a symbolic link, not a regular file, or a path out
    of its directory; the message names it."""


def contained_file(
    directory: str | os.PathLike, name: str | os.PathLike, *, hub_links: bool = False
) -> Path:
    """``directory / name``, after checking that it stays in ``directory``.

    ``name`` is a relative path (``tokenizer.json``, ``1_Pooling/config.json``); the path is
    returned whether or not it exists (``.is_file()`` then tells).

    Raises:
        UnsafePathError: ``name`` is absolute or has a ``..`` part; an existing part of the
            path below ``directory`` is a symbolic link (one into the hub's ``blobs`` with
            ``hub_links``); the entry exists and is not a regular file.
    """
    directory = Path(directory)
    parts = PurePath(name).parts
    if not parts or PurePath(name).is_absolute() or ".." in parts:
        raise UnsafePathError(f"{directory / name}: not a file of {directory}; {RULE}")
    blobs = _hub_blobs(directory) if hub_links else None
    path = directory
    for depth, part in enumerate(parts, 1):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            break  # absent: the caller decides whether it must exist
        last = depth == len(parts)
        if stat.S_ISLNK(mode):
            if last and blobs is not None and _is_hub_blob(path, blobs):
                break
            raise UnsafePathError(f"{path}: a symbolic link (to {os.readlink(path)}); {RULE}")
        if last and not stat.S_ISREG(mode):
            raise UnsafePathError(f"{path}: not a regular file; {RULE}")
        if not last and not stat.S_ISDIR(mode):
            break  # a file where a directory should be: the path does not exist
    return directory.joinpath(*parts)


def check_entries(
    directory: str | os.PathLike,
    subdirectories: tuple[str, ...] = (),
    *,
    hub_links: bool = False,
) -> None:
    """Every entry of ``directory`` (and of its ``subdirectories`` that exist) is a regular
    file or a directory, none a link: for a library that opens files of a directory itself
    (``transformers.AutoTokenizer``), which files it opens being its business.

    Raises:
        UnsafePathError: the first entry that is not, named.
    """
    directory = Path(directory)
    blobs = _hub_blobs(directory) if hub_links else None
    folders = [directory]
    for name in subdirectories:
        folder = contained_directory(directory, name)
        if folder is not None:
            folders.append(folder)
    for folder in folders:
        with os.scandir(folder) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                path = Path(entry.path)
                if entry.is_symlink():
                    if blobs is not None and _is_hub_blob(path, blobs):
                        continue
                    raise UnsafePathError(
                        f"{path}: a symbolic link (to {os.readlink(path)}); {RULE}"
                    )
                if not entry.is_file(follow_symlinks=False) and not entry.is_dir(
                    follow_symlinks=False
                ):
                    raise UnsafePathError(f"{path}: not a regular file; {RULE}")


def contained_directory(directory: str | os.PathLike, name: str) -> Path | None:
    """The subdirectory ``name`` of ``directory`` (None when there is none); UnsafePathError
    when it is a link, or is not a directory."""
    path = Path(directory) / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        raise UnsafePathError(f"{path}: a symbolic link (to {os.readlink(path)}); {RULE}")
    if not stat.S_ISDIR(mode):
        raise UnsafePathError(f"{path}: expected a directory; {RULE}")
    return path


def read_json(
    path: Path, error: type[UserError], *, max_bytes: int | None = None, hint: str = ""
) -> object:
    """The JSON value of the file ``path`` (checked by :func:`contained_file`).

    Raises:
        ``error``: the file is larger than ``max_bytes``, not UTF-8, not JSON, or nested too
            deeply for Python's parser (a RecursionError otherwise); the message names the
            file and ends with ``hint``.
    """
    if max_bytes is not None and path.stat().st_size > max_bytes:
        raise error(f"{path}: {path.stat().st_size} bytes, more than the {max_bytes} read{hint}")
    try:
        return json.loads(path.read_bytes())
    except RecursionError:
        reason = "nested deeper than Python's JSON parser can read"
    except (json.JSONDecodeError, UnicodeDecodeError) as decode_error:
        reason = str(decode_error)
    raise error(f"{path}: not valid JSON ({reason}){hint}")


def _hub_blobs(directory: Path) -> Path | None:
    """``<repo>/blobs`` when ``directory`` is a hub cache snapshot ``<repo>/snapshots/<rev>``
    (``blobs`` a directory, not a link)."""
    snapshot = directory.resolve()
    if snapshot.parent.name != "snapshots":
        return None
    blobs = snapshot.parent.parent / "blobs"
    try:
        return blobs if stat.S_ISDIR(os.lstat(blobs).st_mode) else None
    except OSError:
        return None


def _is_hub_blob(link: Path, blobs: Path) -> bool:
    """Whether ``link`` leads, in one step, to a regular file directly in ``blobs``."""
    target = Path(os.path.normpath(link.parent.resolve() / os.readlink(link)))
    try:
        return target.parent == blobs and stat.S_ISREG(os.lstat(target).st_mode)
    except OSError:
        return False
