"""The executor interface: run one step of a paged decoder over caches the executor owns."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

from attnexport.backends.block_copy import copy_blocks, swap_blocks
from attnexport.model_interface import CacheSpec
from attnexport.runtime.model_input import ModelInput


def _pairs(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


class Executor(abc.ABC):
    """Owns a model and its KV caches; the engine calls :meth:`initialize_cache` once, then per
    step the block moves and :meth:`execute_numpy` (which calls :meth:`execute` by default).

    Caches are torch tensors in the standard layout ``[num_blocks, block_size, Hkv, D]``
    (``kv_caches``, on the executor's device) plus a CPU swap pool (``cpu_caches``); an executor
    whose runtime is not torch shares their memory with it. An encoder-decoder's cross caches
    follow its self caches in ``kv_caches``; block moves (swaps, copy-on-write) concern the self
    caches only, so the CPU pool has no cross caches.
    """

    name: ClassVar[str]

    def __init__(
        self,
        cache_spec: CacheSpec,
        vocab_size: int,
        max_model_len: int | None,
        device: torch.device | str,
    ) -> None:
        self.cache_spec = cache_spec
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.kv_caches: list[torch.Tensor] = []
        self.cpu_caches: list[torch.Tensor] = []
        self.decoder_start_token_id: int | None = None
        """Encoder-decoder models: the decoder start token, when the model states it."""

    @property
    def num_blocks(self) -> int:
        return self.kv_caches[0].shape[0] if self.kv_caches else 0

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocates the device pool and the CPU swap pool (zeroed)."""
        self.kv_caches = self.cache_spec.allocate(num_blocks, self.device)
        self_only = dataclasses.replace(self.cache_spec, num_cross_layers=0)
        self.cpu_caches = self_only.allocate(num_cpu_blocks, "cpu")
        self._bind_caches()

    @property
    def self_caches(self) -> list[torch.Tensor]:
        """The self-attention caches ``[k_0, v_0, ...]`` (all of ``kv_caches`` for a decoder)."""
        return self.kv_caches[: 2 * self.cache_spec.num_layers]

    def _bind_caches(self) -> None:  # noqa: B027  (an optional hook)
        """Hook for executors that must register the cache memory with their runtime."""

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks to CPU blocks: ``pairs`` of (device block, CPU block)."""
        mapping = _pairs(pairs)
        for device_cache, cpu_cache in zip(self.self_caches, self.cpu_caches, strict=True):
            swap_blocks(device_cache, cpu_cache, mapping)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies CPU blocks to device blocks: ``pairs`` of (CPU block, device block)."""
        mapping = _pairs(pairs)
        for device_cache, cpu_cache in zip(self.self_caches, self.cpu_caches, strict=True):
            swap_blocks(cpu_cache, device_cache, mapping)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copies device blocks within the pool (copy-on-write): (source, destination) pairs."""
        copy_blocks(self.self_caches, _pairs(pairs))

    @abc.abstractmethod
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """Runs one step (writing the new tokens' keys/values into ``kv_caches``).

        Returns:
            ``[N, vocab_size]`` float32 logits on the CPU, one row per ``logits_indices`` entry.
        """

    def execute_numpy(self, model_input: ModelInput) -> np.ndarray:
        """:meth:`execute` with the logits as a NumPy array ``[N, vocab_size]`` (float32 or
        float64), as the engine samples them. An executor whose runtime fills host arrays
        overrides it, so that a step touches no torch code on the host."""
        logits = self.execute(model_input).detach()
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()  # NumPy has no bfloat16
        return logits.cpu().numpy()

    def describe(self) -> str:
        """A one-line description (executor, device, backend or provider)."""
        return f"{self.name} on {self.device}"
