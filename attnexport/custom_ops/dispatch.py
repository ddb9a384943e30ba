"""Kernel backends: the interface, the registry, and per-call selection.

The ops that run on a backend (the ``OPS``) describe each call as an :class:`AttentionCall`,
ask :func:`select_backend` for a backend that can run it, and hand it the call's arguments as
one typed call (:class:`~.reshape_and_cache.CacheWriteCall`,
:class:`~.paged_attention.PagedAttentionCall`, :class:`~.varlen_attention.VarlenAttentionCall`;
the backend interface that takes them is :class:`~.backend.AttentionBackend`). Concrete
backends (``sdpa``, ``ipex``, ``xformers``) live in :mod:`attnexport.backends` and register
themselves here (``import attnexport`` imports them), so the ops layer never imports them.
This module imports no op slice: the slices import it (``tests/test_layering.py`` checks, type
annotations included).

Selection: ``use_backend(name)`` (a context manager) beats ``set_default_backend(name)``, which
beats the ``ATTNEXPORT_BACKEND`` environment variable read at import; the default is ``auto``.
``auto`` takes the highest-priority available backend that reports no reason against the call.
A named backend that cannot run a call raises :class:`BackendUnsupportedError` listing why.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from attnexport.errors import UserError

AUTO = "auto"
OPS = ("reshape_and_cache", "paged_attention", "varlen_attention")


class BackendUnsupportedError(UserError, RuntimeError):
    """No selected backend can run a call; the message lists each backend's reasons."""


class AttentionCall(NamedTuple):
    """What one op call asks of a backend, described before any kernel runs (an immutable,
    hashable record: selection is remembered per call; a NamedTuple because one is made per op
    call and a frozen dataclass costs several times more to build)."""

    op: str
    """One of ``OPS``."""
    device_type: str
    dtype: torch.dtype
    num_heads: int
    """Query heads H (equal to num_kv_heads for a cache write)."""
    num_kv_heads: int
    head_size: int
    block_size: int | None = None
    """Tokens per cache block; None for varlen_attention."""
    causal: bool = True
    alibi: bool = False
    sliding_window: bool = False
    soft_cap: bool = False
    sinks: bool = False
    """A learned logit per head in the softmax's denominator (paged_attention's ``sinks``)."""
    decode_only: bool = False
    """Every sequence has at most one query token."""
    chunked_prefill: bool = False
    """Some sequence has several query tokens and cached context before them."""
    cache_contiguous: bool = True
    """The caches are contiguous in the [num_blocks, block_size, num_kv_heads, head_size] layout."""
    cache_dtype: torch.dtype | None = None
    """The KV caches' dtype (int8: with scale caches); None for varlen_attention (no cache)."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run, as data; :meth:`reasons` turns it into per-call reasons."""

    ops: frozenset[str]
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    head_sizes: frozenset[int] | None = None
    """Supported head sizes; None means any."""
    max_head_size: int | None = None
    block_size_multiple: int = 1
    """Block sizes must be a multiple of this."""
    alibi: bool = True
    sliding_window: bool = True
    soft_cap: bool = True
    sinks: bool = False
    """Attention sinks (paged_attention's ``sinks``); off unless a backend says it runs them."""
    non_causal: bool = True
    chunked_prefill: bool = True
    cache_dtypes: frozenset[torch.dtype] = frozenset()
    """KV cache dtypes the backend runs under activations of another dtype (a cache of the
    activations' dtype always runs)."""
    cache_dtype_reason: str = "its kernels take caches of the activations' dtype only"
    """Why other cache dtypes cannot run (the end of the refusal)."""
    notes: tuple[str, ...] = field(default=())
    """Restrictions that depend on the call beyond these fields, for humans (CLI, docs)."""

    def reasons(self, call: AttentionCall) -> list[str]:
        """The reasons these capabilities exclude ``call`` (empty when they admit it)."""
        reasons = []
        if call.op not in self.ops:
            reasons.append(f"op={call.op} (supported: {sorted(self.ops)})")
        if call.device_type not in self.devices:
            reasons.append(f"device={call.device_type} (supported: {sorted(self.devices)})")
        if call.dtype not in self.dtypes:
            names = sorted(str(d) for d in self.dtypes)
            reasons.append(f"dtype={call.dtype} (supported: {names})")
        if self.head_sizes is not None and call.head_size not in self.head_sizes:
            reasons.append(f"head_size={call.head_size} (supported: {sorted(self.head_sizes)})")
        if self.max_head_size is not None and call.head_size > self.max_head_size:
            reasons.append(f"head_size={call.head_size} (max: {self.max_head_size})")
        if call.block_size is not None and call.block_size % self.block_size_multiple:
            reasons.append(
                f"block_size={call.block_size} (must be a multiple of {self.block_size_multiple})"
            )
        cache_dtype = call.cache_dtype
        if cache_dtype not in (None, call.dtype) and cache_dtype not in self.cache_dtypes:
            name = str(cache_dtype).removeprefix("torch.")
            article = "an" if name[0] in "aeiou" else "a"
            reasons.append(
                f"cannot run {article} {name} KV cache with "
                f"{str(call.dtype).removeprefix('torch.')} activations: "
                f"{self.cache_dtype_reason}"
            )
        if call.op != "reshape_and_cache":
            for wanted, supported, what in (
                (call.alibi, self.alibi, "ALiBi"),
                (call.sliding_window, self.sliding_window, "sliding window"),
                (call.soft_cap, self.soft_cap, "logits soft-cap"),
                (call.sinks, self.sinks, "attention sinks"),
                (not call.causal, self.non_causal, "non-causal attention"),
                (call.chunked_prefill, self.chunked_prefill, "chunked prefill"),
            ):
                if wanted and not supported:
                    reasons.append(f"{what} is not supported")
        return reasons

    def as_rows(self) -> list[tuple[str, str]]:
        """(feature, value) pairs for capability tables."""

        def yes(flag: bool) -> str:
            return "yes" if flag else "no"

        return [
            ("ops", ", ".join(op for op in OPS if op in self.ops)),
            ("devices", ", ".join(sorted(self.devices))),
            ("dtypes", ", ".join(sorted(str(d).removeprefix("torch.") for d in self.dtypes))),
            (
                "head sizes",
                "any"
                if self.head_sizes is None
                else ", ".join(str(h) for h in sorted(self.head_sizes)),
            ),
            (
                "block sizes",
                "any"
                if self.block_size_multiple == 1
                else f"multiples of {self.block_size_multiple}",
            ),
            ("ALiBi", yes(self.alibi)),
            ("sliding window", yes(self.sliding_window)),
            ("soft-cap", yes(self.soft_cap)),
            ("attention sinks", yes(self.sinks)),
            ("non-causal", yes(self.non_causal)),
            ("chunked prefill", yes(self.chunked_prefill)),
            (
                "other cache dtypes",
                ", ".join(sorted(str(d).removeprefix("torch.") for d in self.cache_dtypes)) or "no",
            ),
        ]


class KernelBackend(Protocol):
    """What the registry and selection read of a backend: its name, its priority and the
    reasons it cannot run a call. The kernels themselves (one method per op, each taking the
    op's typed call) are :class:`~attnexport.custom_ops.backend.AttentionBackend`'s, which every
    registered backend subclasses; this module imports none of the op slices that define the
    typed calls (they import :func:`select_backend` from here)."""

    name: str
    priority: int

    def not_supported_reasons(self, call: AttentionCall) -> list[str]: ...

    def reshape_and_cache(self, call) -> None: ...

    def paged_attention(self, call) -> torch.Tensor: ...

    def varlen_attention(self, call) -> torch.Tensor: ...


_REGISTRY: dict[str, KernelBackend] = {}
_selected: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "attnexport_backend", default=None
)
_default_name: str = os.environ.get("ATTNEXPORT_BACKEND", AUTO).strip().lower() or AUTO
# Selection depends only on (name, call) while the registry is unchanged, and models repeat the
# same call in every layer, so successful selections are remembered.
_selection_cache: dict[tuple[str, AttentionCall], KernelBackend] = {}


def register_backend(backend: KernelBackend) -> KernelBackend:
    """Adds ``backend`` to the registry under ``backend.name`` (replacing one of that name)."""
    _REGISTRY[backend.name] = backend
    _selection_cache.clear()
    return backend


def registered_backends() -> list[KernelBackend]:
    """All registered backends, highest priority first."""
    return sorted(_REGISTRY.values(), key=lambda b: -b.priority)


def _check_name(name: str) -> str:
    name = name.strip().lower()
    if name != AUTO and name not in _REGISTRY:
        valid = ", ".join([AUTO, *(b.name for b in registered_backends())])
        raise UserError(f"unknown attention backend {name!r}; expected one of: {valid}")
    return name


def get_backend(name: str) -> KernelBackend:
    """The registered backend called ``name``."""
    name = _check_name(name)
    if name == AUTO:
        raise UserError("get_backend: 'auto' is a selection policy, not a backend")
    return _REGISTRY[name]


def set_default_backend(name: str) -> None:
    """Sets the process-wide backend name (``auto`` or a registered backend)."""
    global _default_name
    _default_name = _check_name(name)


def current_backend_name() -> str:
    """The backend name in effect here: the innermost ``use_backend``, else the default."""
    return _selected.get() or _default_name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Runs the enclosed op calls on backend ``name`` (or ``auto``)."""
    token = _selected.set(_check_name(name))
    try:
        yield
    finally:
        _selected.reset(token)


def _describe(call: AttentionCall) -> str:
    parts = [f"dtype={call.dtype}", f"device={call.device_type}", f"head_size={call.head_size}"]
    if call.cache_dtype is not None and call.cache_dtype != call.dtype:
        parts.append(f"cache_dtype={call.cache_dtype}")
    if call.op != "reshape_and_cache":
        parts.append(f"heads={call.num_heads}/{call.num_kv_heads}")
    if call.block_size is not None:
        parts.append(f"block_size={call.block_size}")
    return f"{call.op}({', '.join(parts)})"


def select_backend(call: AttentionCall) -> KernelBackend:
    """The backend that runs ``call`` under the current selection; raises with reasons if none."""
    name = current_backend_name()
    cached = _selection_cache.get((name, call))
    if cached is not None:
        return cached
    backend = _select_uncached(name, call)
    _selection_cache[(name, call)] = backend
    return backend


def _select_uncached(name: str, call: AttentionCall) -> KernelBackend:
    name = _check_name(name)  # the environment's name is only checked here, once
    if name != AUTO:
        backend = _REGISTRY[name]
        reasons = backend.not_supported_reasons(call)
        if reasons:
            raise BackendUnsupportedError(
                f"backend {name!r} cannot run {_describe(call)}: " + "; ".join(reasons)
            )
        return backend
    report = []
    for backend in registered_backends():
        reasons = backend.not_supported_reasons(call)
        if not reasons:
            return backend
        report.append(f"{backend.name}: " + "; ".join(reasons))
    raise BackendUnsupportedError(
        f"no attention backend can run {_describe(call)}: " + " | ".join(report)
    )
