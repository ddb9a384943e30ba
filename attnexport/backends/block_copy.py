"""Host-side block moves for paged caches: swapping between pools and copy-on-write.

Whole blocks move with ``index_select``/``index_copy_`` in the standard layout
``[num_blocks, block_size, num_kv_heads, head_size]``, which every backend shares, so these are
plain functions of the kernel layer rather than methods of an attention backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() not in (3, 4):  # 3-D: the scale cache of an int8 cache
        raise ValueError(
            f"{name}: expected a 4-D cache [num_blocks, block_size, num_kv_heads, head_size] "
            f"or a 3-D scale cache [num_blocks, block_size, num_kv_heads], "
            f"got shape {tuple(cache.shape)}"
        )


def check_block_mapping(
    name: str, src_to_dst: torch.Tensor, src_blocks: int, dst_blocks: int
) -> None:
    """Validates an ``[n, 2]`` int64 (source block, destination block) mapping."""
    if src_to_dst.dtype != torch.int64:
        raise TypeError(f"{name}: expected dtype torch.int64, got {src_to_dst.dtype}")
    if src_to_dst.dim() != 2 or src_to_dst.shape[1] != 2:
        raise ValueError(f"{name}: expected shape [n, 2], got {tuple(src_to_dst.shape)}")
    if src_to_dst.numel() == 0:
        return
    src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
    for column, ids, limit in (("source", src, src_blocks), ("destination", dst, dst_blocks)):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= limit:
            bad = low if low < 0 else high
            raise ValueError(
                f"{name}: {column} block {bad} is out of range; expected ids in [0, {limit})"
            )
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"{name}: expected distinct destination blocks, got a block written twice")


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
    if src_to_dst.numel() == 0:
        return
    blocks = src_cache.index_select(0, src_to_dst[:, 0].to(src_cache.device))
    dst_ids = src_to_dst[:, 1].to(dst_cache.device)
    dst_cache.index_copy_(0, dst_ids, blocks.to(dst_cache.device, non_blocking=True))


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
    if src_to_dst.numel() == 0:
        return
    for cache in caches:
        mapping = src_to_dst.to(cache.device)
        cache.index_copy_(0, mapping[:, 1], cache.index_select(0, mapping[:, 0]))
