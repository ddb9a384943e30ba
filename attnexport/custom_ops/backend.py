"""The interface of a kernel backend: selection (name, priority, capabilities, the reasons
it cannot run a call) and one kernel per op, each taking the op's typed call. Concrete
backends (``sdpa``, ``ipex``, ``xformers``) subclass it in :mod:`attnexport.backends` and
register with :func:`~attnexport.custom_ops.dispatch.register_backend`."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from attnexport.custom_ops.dispatch import AttentionCall, BackendCapabilities
from attnexport.custom_ops.paged_attention import PagedAttentionCall
from attnexport.custom_ops.reshape_and_cache import CacheWriteCall
from attnexport.custom_ops.varlen_attention import VarlenAttentionCall


class AttentionBackend(abc.ABC):
    """A set of kernels for the attnexport ops over the standard cache layout.

    Subclasses set ``name``, ``priority`` (higher is preferred by ``auto``) and
    ``capabilities``, and implement the three kernels, each taking the op's typed call. Inputs
    reach a kernel already validated.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    capabilities: ClassVar[BackendCapabilities]

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run on this machine at all (missing package, no GPU)."""
        return None

    def is_available(self) -> bool:
        return self.unavailable_reason() is None

    def not_supported_reasons(self, call: AttentionCall) -> list[str]:
        """Every reason this backend cannot run ``call``; empty when it can."""
        unavailable = self.unavailable_reason()
        if unavailable is not None:
            return [unavailable]
        return self.capabilities.reasons(call)

    @abc.abstractmethod
    def reshape_and_cache(self, call: CacheWriteCall) -> None:
        """Writes key/value [T, Hkv, D] into the caches at ``slot_mapping``; negative skips."""

    @abc.abstractmethod
    def paged_attention(self, call: PagedAttentionCall) -> torch.Tensor:
        """Attention of query [T, H, D] over the paged caches; returns [T, H, D]."""

    @abc.abstractmethod
    def varlen_attention(self, call: VarlenAttentionCall) -> torch.Tensor:
        """Attention over packed ragged sequences without a cache; returns [Tq, H, D]."""
