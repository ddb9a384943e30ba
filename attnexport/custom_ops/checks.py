"""Input checks shared by the op slices, run before any kernel.

Two layers of checks:

* *static* checks (dtype, rank, shape relations, scalar arguments) run in both the real kernels
  and the fake kernels. Shape relations go through ``torch._check_with`` so that symbolic
  shapes under ``torch.export`` become guards instead of data-dependent errors.
* *value* checks (slot and block ids in range, monotone offsets, lengths that fit the block
  table) read tensor contents, so they only run on real tensors. Metadata tensors are shared
  by every layer of a step: inside an executor's :func:`~.planning.step_plan` their value
  checks run on the first layer and are kept in the plan; a call outside a plan (or on metadata
  the plan does not own) checks every value, every call.

Every error names the argument and the value that was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from attnexport.custom_ops.kv_cache_dtype import CACHE_DTYPES, SCALE_DTYPE, is_scaled

INDEX_DTYPE = torch.int32
SLOT_DTYPES = (torch.int32, torch.int64)
CACHE_DIMS = "[num_blocks, block_size, num_kv_heads, head_size]"
TOKEN_DIMS = "[num_tokens, num_kv_heads, head_size]"


def expect(cond, message: Callable[[], str] | str, error: type[Exception] = ValueError) -> None:
    """Raise ``error(message)`` unless ``cond``; works on plain and symbolic booleans."""
    if cond is True:  # concrete shapes: skip torch._check_with, a measurable cost per op call
        return
    torch._check_with(error, cond, message if callable(message) else lambda: message)


def expect_rank(name: str, tensor: torch.Tensor, rank: int, dims: str) -> None:
    if tensor.dim() != rank:  # a rank is never symbolic
        raise ValueError(
            f"{name}: expected a {rank}-D tensor {dims}, got shape {tuple(tensor.shape)}"
        )


def expect_ranks(dims: str, **tensors: torch.Tensor) -> None:
    """Each tensor has the rank of ``dims`` (a ``[a, b, ...]`` description)."""
    rank = dims.count(",") + 1
    for name, tensor in tensors.items():
        expect_rank(name, tensor, rank, dims)


def expect_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        expected = " or ".join(str(d) for d in allowed)
        raise TypeError(f"{name}: expected dtype {expected}, got {tensor.dtype}")


def expect_floating(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {tensor.dtype}")


def expect_like(attribute: str, reference_name: str, reference: torch.Tensor, **tensors) -> None:
    """Each tensor has the ``attribute`` (``"dtype"``: else TypeError, or ``"shape"``: else
    ValueError) of ``reference``. Sizes compare to a plain bool (a symbolic one is guarded)."""
    expected = getattr(reference, attribute)
    for name, tensor in tensors.items():
        actual = getattr(tensor, attribute)
        if actual != expected:
            error, show = (TypeError, str) if attribute == "dtype" else (ValueError, tuple)
            raise error(
                f"{name}: expected {attribute} {show(expected)} (the {attribute} of "
                f"{reference_name}), got {show(actual)}"
            )


def expect_same_device(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    """Every tensor is on the device of the first (``names[i]`` names ``tensors[i]``)."""
    first = tensors[0].device
    for i, tensor in enumerate(tensors):
        if tensor.device != first:
            raise ValueError(
                f"{names[i]}: expected device {first} (the device of {names[0]}), "
                f"got {tensor.device}"
            )


def expect_head_size(query: torch.Tensor, head_size, source: str) -> None:
    """query ``[T, H, D]`` has head size ``head_size`` (that of ``source``)."""
    expect(
        query.shape[2] == head_size,
        lambda: (
            f"query: expected head_size {head_size} (the head_size of {source}), "
            f"got shape {tuple(query.shape)}"
        ),
    )


def is_fake(*tensors: torch.Tensor) -> bool:
    """True while tracing (fake or meta tensors): value checks must be skipped."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(t, FakeTensor) or t.is_meta for t in tensors)


def check_heads(num_heads, num_kv_heads, query_name: str, kv_name: str) -> None:
    expect(
        num_kv_heads > 0 and num_heads % num_kv_heads == 0,
        lambda: (
            f"{query_name}: num_heads ({num_heads}) must be a multiple of the "
            f"num_kv_heads of {kv_name} ({num_kv_heads})"
        ),
    )


def check_offsets(name: str, offsets: torch.Tensor, total: int, total_name: str) -> torch.Tensor:
    """Checks a cumulative-offset tensor [S+1]; returns the per-sequence lengths [S] int64
    (differences taken in int64: in int32 a decreasing pair can wrap to a positive length)."""
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    first = int(offsets[0])
    last = int(offsets[-1])
    if first != 0:
        raise ValueError(f"{name}: expected {name}[0] == 0, got {first}")
    if offsets.numel() > 1 and int(lengths.min()) < 0:
        raise ValueError(f"{name}: expected non-decreasing offsets, got {offsets.tolist()}")
    if last != total:
        raise ValueError(f"{name}: expected {name}[-1] == {total} ({total_name}), got {last}")
    return lengths


@dataclass(frozen=True)
class BatchSummary:
    """Host-side facts about a batch, derived once from validated metadata."""

    num_seqs: int
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    """Every sequence has exactly one query token (or none)."""
    has_context: bool
    """Some sequence with more than one query token also has cached context (chunked prefill)."""


def check_cache_dtype(
    activation_name: str,
    activation: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale_cache: torch.Tensor | None,
    value_scale_cache: torch.Tensor | None,
) -> None:
    """The caches [num_blocks, block_size, Hkv, D] share a cache dtype (float32, float16,
    bfloat16 or int8, independent of the float ``activation``'s dtype; float64, the reference
    precision, only with float64 activations and they only with it); int8 caches come with
    float32 scale caches [num_blocks, block_size, Hkv] (the scale of each row, same block and
    offset), float caches without them (docs/ops.md, "KV cache dtypes")."""
    if torch.float64 in (activation.dtype, key_cache.dtype):
        expect_like("dtype", activation_name, activation, key_cache=key_cache)
    expect_dtype("key_cache", key_cache, CACHE_DTYPES)
    expect_like("dtype", "key_cache", key_cache, value_cache=value_cache)
    scales = {"key_scale_cache": key_scale_cache, "value_scale_cache": value_scale_cache}
    if not is_scaled(key_cache.dtype):
        for name, scale in scales.items():
            if scale is not None:
                raise ValueError(
                    f"{name}: expected None with {key_cache.dtype} caches (scale caches go "
                    f"with int8 caches only), got a tensor"
                )
        return
    expected = tuple(key_cache.shape[:3])
    for name, scale in scales.items():
        if scale is None:
            raise ValueError(
                f"{name}: required with int8 caches (float32 [num_blocks, block_size, "
                f"num_kv_heads], the scale of each cache row), got None"
            )
        expect_dtype(name, scale, (SCALE_DTYPE,))
        expect_rank(name, scale, 3, "[num_blocks, block_size, num_kv_heads]")
        expect(
            scale.shape[0] == key_cache.shape[0]
            and scale.shape[1] == key_cache.shape[1]
            and scale.shape[2] == key_cache.shape[2],
            lambda name=name, scale=scale: (
                f"{name}: expected shape {expected} (num_blocks, block_size, num_kv_heads of "
                f"key_cache), got {tuple(scale.shape)}"
            ),
        )
        expect_same_device(("key_cache", name), (key_cache, scale))
