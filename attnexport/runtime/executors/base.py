"""The executor interface: run one step of a paged decoder over caches the executor owns.

This module imports no torch: the serving core (engine, scheduler, onnxruntime executor) runs
without it."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from attnexport.model_interface import CacheSpec
from attnexport.runtime.executors.cache_pool import CachePool
from attnexport.runtime.model_input import ModelInput
from attnexport.runtime.sampling import host_logits


@dataclass(frozen=True)
class Device:
    """A device named like torch names it (``cpu``, ``cuda``, ``cuda:1``), without torch."""

    type: str
    index: int | None = None

    @classmethod
    def parse(cls, device: Any) -> Device:
        """``device``: a name, or anything with ``type`` and ``index`` (a ``torch.device``)."""
        if not isinstance(device, str):
            return cls(device.type, device.index)
        kind, _, index = device.strip().partition(":")
        return cls(kind, int(index) if index.isdigit() else None)

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class Executor(abc.ABC):
    """Owns a model and its KV caches; the engine calls :meth:`initialize_cache` once, then per
    step the block moves and :meth:`execute_numpy` (which calls :meth:`execute` by default).

    The caches live in a :class:`~attnexport.runtime.executors.cache_pool.CachePool` the
    executor makes (:meth:`_make_cache_pool`): ``kv_caches`` ``[num_blocks, block_size, Hkv, D]``
    in the standard layout on the executor's device, plus a CPU swap pool (``cpu_caches``).
    An encoder-decoder's cross caches follow its self caches in ``kv_caches``; block moves
    (swaps, copy-on-write) concern the self caches only, so the CPU pool has no cross caches.
    """

    name: ClassVar[str]

    def __init__(
        self,
        cache_spec: CacheSpec,
        vocab_size: int,
        max_model_len: int | None,
        device: Any,
        rope_switch_length: int | None = None,
    ) -> None:
        self.cache_spec = cache_spec
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        """The device the caches live on: anything with ``type`` (a ``torch.device`` or a
        :class:`Device`)."""
        self.cache_pool: CachePool | None = None
        self.decoder_start_token_id: int | None = None
        """Encoder-decoder models: the decoder start token, when the model states it."""
        self.rope_switch_length = rope_switch_length
        """LongRoPE models: the sequence length past which keys get other RoPE factors (the
        engine recomputes a sequence that crosses it); None for every other model."""

    @property
    def kv_caches(self) -> list:
        """The device caches (empty before :meth:`initialize_cache`)."""
        return self.cache_pool.kv_caches if self.cache_pool is not None else []

    @property
    def cpu_caches(self) -> list:
        """The CPU swap pool's caches (empty before :meth:`initialize_cache`)."""
        return self.cache_pool.cpu_caches if self.cache_pool is not None else []

    @property
    def self_caches(self) -> list:
        """The self-attention caches ``[k_0, v_0, ...]`` (all of ``kv_caches`` for a decoder)."""
        return self.kv_caches[: self.cache_spec.num_self_tensors]

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0].shape[0] if self.kv_caches else 0

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the device pool and the CPU swap pool (zeroed)."""
        self.cache_pool = self._make_cache_pool(num_blocks, num_cpu_blocks)
        self._bind_caches()

    @abc.abstractmethod
    def _make_cache_pool(self, num_blocks: int, num_cpu_blocks: int) -> CachePool:
        """The executor's zeroed caches: ``num_blocks`` on its device, ``num_cpu_blocks`` in
        the CPU swap pool."""

    def _bind_caches(self) -> None:  # noqa: B027  (an optional hook)
        """Hook for executors that must register the cache memory with their runtime."""

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to CPU blocks: ``pairs`` of (device block, CPU block)."""
        self.cache_pool.swap_out(pairs)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies CPU blocks to device blocks: ``pairs`` of (CPU block, device block)."""
        self.cache_pool.swap_in(pairs)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks within the pool (copy-on-write): (source, destination) pairs."""
        self.cache_pool.copy_blocks(pairs)

    @abc.abstractmethod
    def execute(self, model_input: ModelInput):
        """Runs one step (writing the new tokens' keys/values into ``kv_caches``).

        Returns:
            ``[N, vocab_size]`` logits on the host, one row per ``logits_indices`` entry (a
            torch tensor from the torch executor, float32).
        """

    def execute_numpy(self, model_input: ModelInput) -> np.ndarray:
        """:meth:`execute` with the logits as a NumPy array ``[N, vocab_size]`` (float32 or
        float64), as the engine samples them. An executor whose runtime fills host arrays
        overrides it, so that a step touches no torch code on the host."""
        return host_logits(self.execute(model_input))

    def describe(self) -> str:
        """A one-line description (executor, device, backend or provider)."""
        return f"{self.name} on {self.device}"
