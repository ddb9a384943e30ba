"""``reshape_and_cache`` and its functional twin: new keys and values into the paged caches."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.dispatch import AttentionCall, select_backend
from attnexport.custom_ops.library import register
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.spec import OpSpec

_ARGS = "Tensor key, Tensor value, Tensor{} key_cache, Tensor{} value_cache, Tensor slot_mapping"
SCHEMA = f"({_ARGS.format('(a!)', '(b!)')}) -> ()"
FUNCTIONAL_SCHEMA = f"({_ARGS.format('', '')}) -> (Tensor, Tensor)"


class CacheWriteCall(NamedTuple):
    """The arguments of :func:`reshape_and_cache` (and of its functional twin), as a backend
    receives them."""

    key: torch.Tensor
    """``[T, Hkv, D]``, the cache dtype."""
    value: torch.Tensor
    """As key."""
    key_cache: torch.Tensor
    """``[num_blocks, block_size, Hkv, D]``; written in place."""
    value_cache: torch.Tensor
    """As key_cache."""
    slot_mapping: torch.Tensor
    """``[T]`` int32 or int64. Token t goes to block ``slot // block_size``, offset
    ``slot % block_size``; a negative slot marks a padding token (skipped)."""


def check(call: CacheWriteCall) -> None:
    """Validates a cache write; see :class:`CacheWriteCall` for the contract."""
    key, value, key_cache, value_cache, slot_mapping = call
    checks.expect_floating("key", key)
    checks.expect_ranks(checks.TOKEN_DIMS, key=key, value=value)
    checks.expect_ranks(checks.CACHE_DIMS, key_cache=key_cache, value_cache=value_cache)
    checks.expect_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.expect_dtype("slot_mapping", slot_mapping, checks.SLOT_DTYPES)
    checks.expect_like(
        "dtype", "key", key, value=value, key_cache=key_cache, value_cache=value_cache
    )
    checks.expect_same_device(call._fields, call)
    checks.expect(
        key.shape[1] == key_cache.shape[2] and key.shape[2] == key_cache.shape[3],
        lambda: (
            f"key: expected [num_tokens, {key_cache.shape[2]}, {key_cache.shape[3]}] "
            f"(num_kv_heads and head_size of key_cache), got {tuple(key.shape)}"
        ),
    )
    checks.expect_like("shape", "key", key, value=value)
    checks.expect_like("shape", "key_cache", key_cache, value_cache=value_cache)
    checks.expect(
        slot_mapping.shape[0] == key.shape[0],
        lambda: (
            f"slot_mapping: expected shape [{key.shape[0]}] (one slot per key token), "
            f"got {tuple(slot_mapping.shape)}"
        ),
    )
    if checks.is_fake(key, key_cache, slot_mapping) or slot_mapping.numel() == 0:
        return
    capacity = key_cache.shape[0] * key_cache.shape[1]
    memoised("slots", (slot_mapping,), (capacity,), lambda: _check_slots(slot_mapping, capacity))


def _check_slots(slot_mapping: torch.Tensor, capacity: int) -> bool:
    """Value checks of a non-empty ``slot_mapping`` [T] int32/int64 for ``capacity`` slots."""
    largest = int(slot_mapping.max())
    if largest >= capacity:
        raise ValueError(
            f"slot_mapping: slot {largest} is out of range; expected slots < {capacity} "
            f"(num_blocks * block_size), or negative for padding"
        )
    valid = slot_mapping[slot_mapping >= 0]
    if valid.numel() > 1 and torch.unique(valid).numel() != valid.numel():
        raise ValueError("slot_mapping: expected distinct slots, got a slot written twice")
    return True


def _write(call: CacheWriteCall) -> None:
    """Runs a validated write on the selected backend."""
    key, key_cache = call.key, call.key_cache
    request = AttentionCall(
        op="reshape_and_cache",
        device_type=key.device.type,
        dtype=key.dtype,
        num_heads=key.shape[1],
        num_kv_heads=key.shape[1],
        head_size=key.shape[2],
        block_size=key_cache.shape[1],
        cache_contiguous=key_cache.is_contiguous(),
    )
    select_backend(request).reshape_and_cache(call)


def reshape_and_cache(*args) -> None:
    """Writes new keys and values into the paged caches, in place.

    Takes the arguments of :class:`CacheWriteCall` (by position or name).
    """
    call = CacheWriteCall(*args)
    check(call)
    _write(call)


def reshape_and_cache_functional(*args) -> tuple[torch.Tensor, torch.Tensor]:
    """The functional twin of :func:`reshape_and_cache`, used by the lowering.

    Same arguments; the caches are left untouched and the written copies
    ``(new_key_cache, new_value_cache)`` are returned.
    """
    call = CacheWriteCall(*args)
    check(call)
    copies = call._replace(key_cache=call.key_cache.clone(), value_cache=call.value_cache.clone())
    _write(copies)
    return copies.key_cache, copies.value_cache


def _fake(*args) -> None:
    check(CacheWriteCall(*args))


def _fake_functional(*args) -> tuple[torch.Tensor, torch.Tensor]:
    call = CacheWriteCall(*args)
    check(call)
    return torch.empty_like(call.key_cache), torch.empty_like(call.value_cache)


def reference(*args, **kwargs) -> None:
    """Reference of ``attnexport::reshape_and_cache`` (the arguments of
    :class:`CacheWriteCall`): writes token t of key/value at slot ``slot_mapping[t]``, in
    place; a negative slot skips it."""
    call = CacheWriteCall(*args, **kwargs)
    block_size = call.key_cache.shape[1]
    for t, slot in enumerate(call.slot_mapping.tolist()):
        if slot < 0:
            continue
        call.key_cache[slot // block_size, slot % block_size] = call.key[t]
        call.value_cache[slot // block_size, slot % block_size] = call.value[t]


def _functional_reference(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``attnexport::reshape_and_cache_functional``: the written copies."""
    call = CacheWriteCall(*args, **kwargs)
    copies = call._replace(key_cache=call.key_cache.clone(), value_cache=call.value_cache.clone())
    reference(*copies)
    return copies.key_cache, copies.value_cache


_CACHES = ("key_cache", "value_cache")
SPEC = OpSpec(
    "reshape_and_cache",
    SCHEMA,
    reshape_and_cache,
    _fake,
    reference,
    cache_arguments=_CACHES,
    writes_caches=True,
    backend_op=True,
    call_type=CacheWriteCall,
)
FUNCTIONAL_SPEC = OpSpec(
    "reshape_and_cache_functional",
    FUNCTIONAL_SCHEMA,
    reshape_and_cache_functional,
    _fake_functional,
    _functional_reference,
    cache_arguments=_CACHES,
    backend_op=True,
    call_type=CacheWriteCall,
)
SPECS = (SPEC, FUNCTIONAL_SPEC)

reshape_and_cache = register(SPEC)
reshape_and_cache_functional = register(FUNCTIONAL_SPEC)
