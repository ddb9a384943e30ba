"""The KV cache memory an executor owns: the device pool, the CPU swap pool, and the block
moves between and within them (swaps of preempted sequences, copy-on-write).

:class:`CachePool` is the interface the executors share; :class:`NumpyCachePool` keeps host
caches as NumPy arrays (the onnxruntime executor on the CPU: no torch needed). The torch
caches are :class:`attnexport.runtime.executors.torch_cache_pool.TorchCachePool`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import numpy as np

from attnexport.model_interface import CacheSpec


class CachePool(abc.ABC):
    """Caches ``[num_blocks, block_size, Hkv, D]`` of one :class:`CacheSpec`: ``kv_caches``
    (the device pool: self caches, then an encoder-decoder's cross caches) and ``cpu_caches``
    (the swap pool). Block moves concern the self caches only, so the CPU pool has no cross
    caches."""

    def __init__(self, spec: CacheSpec, kv_caches: list, cpu_caches: list) -> None:
        self.spec = spec
        self.kv_caches = kv_caches
        self.cpu_caches = cpu_caches

    @property
    def self_caches(self) -> list:
        """The self-attention caches ``[k_0, v_0, ...]`` (all of ``kv_caches`` for a decoder;
        with their scale caches for int8 caches)."""
        return self.kv_caches[: self.spec.num_self_tensors]

    @abc.abstractmethod
    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to CPU blocks: ``pairs`` of (device block, CPU block)."""

    @abc.abstractmethod
    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies CPU blocks to device blocks: ``pairs`` of (CPU block, device block)."""

    @abc.abstractmethod
    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks within the pool (copy-on-write): (source, destination) pairs."""


def self_only(spec: CacheSpec) -> CacheSpec:
    """``spec`` without its cross layers: the geometry of the CPU swap pool."""
    return dataclasses.replace(spec, num_cross_layers=0)


def _mapping(
    pairs: Sequence[tuple[int, int]], src_blocks: int, dst_blocks: int
) -> tuple[np.ndarray, np.ndarray]:
    """(sources, destinations) of ``pairs``; raises ValueError naming a block out of range or
    a destination written twice (the same contract as the torch block copies)."""
    mapping = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    src, dst = mapping[:, 0], mapping[:, 1]
    for column, ids, limit in (("source", src, src_blocks), ("destination", dst, dst_blocks)):
        if ids.size and (ids.min() < 0 or ids.max() >= limit):
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(
                f"pairs: {column} block {bad} is out of range; expected ids in [0, {limit})"
            )
    if np.unique(dst).size != dst.size:
        raise ValueError("pairs: expected distinct destination blocks, got a block written twice")
    return src, dst


def _zeroed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # Written now, as torch.zeros does: pages left to be committed as blocks are first used
    # (np.zeros, or an anonymous mapping touched per block before each step) made batch-1
    # decode of SmolLM2-135M ~10% slower (benchmarks: docs/benchmarks.md, "Measured design
    # choices"); the pool's size is what bounds its memory (run sizes it from its requests).
    array = np.empty(shape, dtype)
    array.fill(0)
    return array


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a cache dtype name; ``bfloat16`` is ml_dtypes' (NumPy has none)."""
    if name == "bfloat16":
        import ml_dtypes  # onnx's dependency, so present wherever onnxruntime models are made

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class NumpyCachePool(CachePool):
    """Host caches as NumPy arrays of ``spec.dtype`` (a NumPy dtype), zeroed when made; int8
    caches with their float32 scale caches (``CacheSpec.tensor_shapes``)."""

    def __init__(self, spec: CacheSpec, num_blocks: int, num_cpu_blocks: int) -> None:
        def allocate(geometry: CacheSpec, blocks: int) -> list[np.ndarray]:
            return [
                _zeroed(tuple(shape), numpy_dtype(dtype))
                for shape, dtype in geometry.tensor_shapes(blocks)
            ]

        cpu_caches = allocate(self_only(spec), num_cpu_blocks)
        super().__init__(spec, allocate(spec, num_blocks), cpu_caches)

    def _move(self, sources: list, destinations: list, pairs) -> None:
        if not len(pairs):
            return
        src, dst = _mapping(pairs, len(sources[0]), len(destinations[0]))
        for source, destination in zip(sources, destinations, strict=True):
            destination[dst] = source[src]  # the gather copies first: overlaps are safe

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._move(self.self_caches, self.cpu_caches, pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._move(self.cpu_caches, self.self_caches, pairs)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._move(self.self_caches, self.self_caches, pairs)
