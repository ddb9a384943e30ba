"""Torch caches for the executors whose runtime shares torch memory (the torch executor, the
onnxruntime executor on CUDA); block moves run through :mod:`attnexport.backends.block_copy`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from attnexport.backends.block_copy import copy_blocks, swap_blocks
from attnexport.model_interface import CacheSpec
from attnexport.runtime.executors.cache_pool import CachePool, self_only


def _pairs(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


def torch_dtype(dtype) -> torch.dtype:
    """``dtype`` (a torch dtype, or a NumPy dtype or name like ``float16``) as a torch dtype."""
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))


class TorchCachePool(CachePool):
    """Zeroed torch caches: ``kv_caches`` on ``device``, ``cpu_caches`` on the CPU."""

    def __init__(
        self, spec: CacheSpec, num_blocks: int, num_cpu_blocks: int, device: torch.device | str
    ) -> None:
        spec = dataclasses.replace(spec, dtype=torch_dtype(spec.dtype))
        super().__init__(
            spec,
            spec.allocate(num_blocks, device),
            self_only(spec).allocate(num_cpu_blocks, "cpu"),
        )

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        mapping = _pairs(pairs)
        for device_cache, cpu_cache in zip(self.self_caches, self.cpu_caches, strict=True):
            swap_blocks(device_cache, cpu_cache, mapping)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        mapping = _pairs(pairs)
        for device_cache, cpu_cache in zip(self.self_caches, self.cpu_caches, strict=True):
            swap_blocks(cpu_cache, device_cache, mapping)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        copy_blocks(self.self_caches, _pairs(pairs))
