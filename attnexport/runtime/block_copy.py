"""Host-side block moves for paged caches: swapping between pools and copy-on-write."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from attnexport.custom_ops.dispatch import backend_for_device
from attnexport.custom_ops.validation import check_block_mapping


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{name}: expected a 4-D cache [num_blocks, block_size, num_kv_heads, head_size], "
            f"got shape {tuple(cache.shape)}"
        )


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, src_to_dst: torch.Tensor) -> None:
    """Copies blocks between two caches (e.g. GPU and CPU pools), in place.

    Args:
        src_cache, dst_cache: ``[num_blocks, block_size, Hkv, D]`` each (block counts and
            devices may differ), same dtype and block shape.
        src_to_dst: ``[n, 2]`` int64 rows of (source block, destination block).
    """
    _check_cache("src_cache", src_cache)
    _check_cache("dst_cache", dst_cache)
    if src_cache.shape[1:] != dst_cache.shape[1:]:
        raise ValueError(
            f"dst_cache: expected block shape {tuple(src_cache.shape[1:])} (that of src_cache), "
            f"got {tuple(dst_cache.shape[1:])}"
        )
    if src_cache.dtype != dst_cache.dtype:
        raise TypeError(
            f"dst_cache: expected dtype {src_cache.dtype} (that of src_cache), "
            f"got {dst_cache.dtype}"
        )
    check_block_mapping("src_to_dst", src_to_dst, src_cache.shape[0], dst_cache.shape[0])
    device = dst_cache.device if dst_cache.device.type != "cpu" else src_cache.device
    backend_for_device(device.type).swap_blocks(src_cache, dst_cache, src_to_dst)


def copy_blocks(caches: Sequence[torch.Tensor], src_to_dst: torch.Tensor) -> None:
    """Copies blocks within each cache (copy-on-write for forked sequences), in place.

    Args:
        caches: key and value caches ``[num_blocks, block_size, Hkv, D]`` of every layer, all
            with the same number of blocks.
        src_to_dst: ``[n, 2]`` int64 rows of (source block, destination block).
    """
    if not caches:
        return
    for i, cache in enumerate(caches):
        _check_cache(f"caches[{i}]", cache)
        if cache.shape[0] != caches[0].shape[0]:
            raise ValueError(
                f"caches[{i}]: expected {caches[0].shape[0]} blocks (as caches[0]), "
                f"got {cache.shape[0]}"
            )
    num_blocks = caches[0].shape[0]
    check_block_mapping("src_to_dst", src_to_dst, num_blocks, num_blocks)
    backend_for_device(caches[0].device.type).copy_blocks(caches, src_to_dst)
