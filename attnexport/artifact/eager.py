"""The torch dtypes of the manifest's dtype names, and rebuilding the eager model an artifact
was exported from."""

from __future__ import annotations

from pathlib import Path

import torch

from attnexport.artifact.manifest import DTYPE_NAMES

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
"""The manifest's dtype names -> torch dtypes."""


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
