"""The writing side of the graph contract: the cache geometry of the sample caches an export
records. The contract itself (:class:`GraphContract`, :func:`read_contract`) lives in
:mod:`attnexport.model_contract`, free of torch and onnx, so that the serving core reads it
without the lowering."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attnexport.model_contract import (  # noqa: F401  (re-exported: the lowering's names)
    CACHE_LAYOUT,
    GraphContract,
    read_contract,
)
from attnexport.model_interface import CacheSpec


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_geometry(
    caches: Mapping[str, torch.Tensor], cache_spec: CacheSpec | None
) -> dict[str, int | str | None]:
    """block_size, num_layers, num_cross_layers, num_kv_heads, head_size and dtype of the
    sample cache tensors, checked against ``cache_spec`` when one is given."""
    if not caches:
        return {}
    first = next(iter(caches.values()))
    found = {
        "block_size": int(first.shape[1]),
        "num_kv_heads": int(first.shape[2]),
        "head_size": int(first.shape[3]),
        "dtype": dtype_name(first.dtype),
    }
    for name, cache in caches.items():
        geometry = (tuple(cache.shape[1:]), cache.dtype)
        if geometry != (tuple(first.shape[1:]), first.dtype):
            raise ValueError(
                f"{name}: expected a cache like the others, [num_blocks, "
                f"{', '.join(map(str, first.shape[1:]))}] {first.dtype}, got "
                f"{list(cache.shape)} {cache.dtype}"
            )
    if cache_spec is None:
        return {**found, "num_layers": len(caches) // 2, "num_cross_layers": 0}
    expected = {
        "block_size": cache_spec.block_size,
        "num_kv_heads": cache_spec.num_kv_heads,
        "head_size": cache_spec.head_size,
        "dtype": dtype_name(cache_spec.dtype),
    }
    for key, value in expected.items():
        if found[key] != value:
            raise ValueError(
                f"cache_spec: {key} is {value} but the sample caches have {found[key]}"
            )
    if cache_spec.num_cache_tensors != len(caches):
        raise ValueError(
            f"cache_spec: expected {cache_spec.num_cache_tensors} cache inputs "
            f"(2 * (num_layers + num_cross_layers)), the model uses {len(caches)}"
        )
    return {
        **found,
        "num_layers": cache_spec.num_layers,
        "num_cross_layers": cache_spec.num_cross_layers,
    }
