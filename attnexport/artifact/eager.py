"""What a manifest rebuilds in torch: the dtypes of its names, the cache geometry and the eager
model an artifact was exported from."""

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
        return load_checkpoint(source["path"], dtype=dtype, impl=manifest.get("impl", "zoo"))
    return None


def manifest_cache_spec(manifest: dict):
    """The :class:`~attnexport.model_interface.CacheSpec` of the manifest's ``cache`` (the
    inverse of :func:`attnexport.artifact.manifest.cache_entry`); None for an encoder."""
    from attnexport.model_interface import CacheSpec

    cache = manifest["cache"]
    if cache is None:
        return None
    return CacheSpec(
        num_layers=cache["num_layers"],
        num_kv_heads=cache["num_kv_heads"],
        head_size=cache["head_size"],
        dtype=getattr(torch, cache["dtype"]),
        block_size=cache["block_size"],
        num_cross_layers=cache.get("num_cross_layers", 0),
    )
