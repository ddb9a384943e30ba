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
    caches: Mapping[str, torch.Tensor],
    cache_spec: CacheSpec | None,
    activation_dtype: torch.dtype | None = None,
) -> dict[str, int | str | None]:
    """block_size, num_layers, num_cross_layers, num_kv_heads, head_size, dtype (the
    activations', ``activation_dtype``; else the caches') and kv_cache_dtype (when it differs)
    of the sample cache tensors (int8 caches with their 3-D float32 scale caches), checked
    against ``cache_spec`` when one is given."""
    if not caches:
        return {}
    scales = {n: c for n, c in caches.items() if c.dim() == 3}
    caches = {n: c for n, c in caches.items() if c.dim() != 3}
    first = next(iter(caches.values()))
    cache_dtype = dtype_name(first.dtype)
    found = {
        "block_size": int(first.shape[1]),
        "num_kv_heads": int(first.shape[2]),
        "head_size": int(first.shape[3]),
        "dtype": dtype_name(activation_dtype) if activation_dtype is not None else cache_dtype,
    }
    if cache_dtype != found["dtype"]:
        found["kv_cache_dtype"] = cache_dtype
    expected_scales = len(caches) if first.dtype == torch.int8 else 0
    if len(scales) != expected_scales:
        raise ValueError(
            f"kv_caches: {len(caches)} {cache_dtype} caches need {expected_scales} scale caches "
            f"[num_blocks, block_size, num_kv_heads] float32, got {len(scales)}"
        )
    for name, scale in scales.items():
        if tuple(scale.shape[1:]) != tuple(first.shape[1:3]) or scale.dtype != torch.float32:
            raise ValueError(
                f"{name}: expected a scale cache [num_blocks, "
                f"{', '.join(map(str, first.shape[1:3]))}] float32, got "
                f"{list(scale.shape)} {scale.dtype}"
            )
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
    found_cache = {**found, "dtype": cache_dtype}
    for key, value in expected.items():
        if found_cache[key] != value:
            raise ValueError(
                f"cache_spec: {key} is {value} but the sample caches have {found_cache[key]}"
            )
    if cache_spec.num_cache_tensors != len(caches) + len(scales):
        raise ValueError(
            f"cache_spec: expected {cache_spec.num_cache_tensors} cache inputs "
            f"({cache_spec.tensors_per_layer} * (num_layers + num_cross_layers)), the model uses "
            f"{len(caches) + len(scales)}"
        )
    return {
        **found,
        "num_layers": cache_spec.num_layers,
        "num_cross_layers": cache_spec.num_cross_layers,
    }
