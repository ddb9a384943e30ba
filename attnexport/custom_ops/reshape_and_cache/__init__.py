"""``reshape_and_cache`` and its functional twin: new keys and values into the paged caches."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.dispatch import AttentionCall, select_backend
from attnexport.custom_ops.kv_cache_dtype import to_cache
from attnexport.custom_ops.library import register
from attnexport.custom_ops.planning import memoised
from attnexport.custom_ops.spec import OpSpec

_ARGS = (
    "Tensor key, Tensor value, Tensor{} key_cache, Tensor{} value_cache, Tensor slot_mapping, "
    "Tensor{}? key_scale_cache=None, Tensor{}? value_scale_cache=None"
)
SCHEMA = f"({_ARGS.format('(a!)', '(b!)', '(c!)', '(d!)')}) -> ()"
# The functional twin returns the written caches, then the written scale caches when the call
# has them (int8 caches): a list of 2 or 4, so that callers of float caches keep unpacking two.
FUNCTIONAL_SCHEMA = f"({_ARGS.format('', '', '', '')}) -> Tensor[]"


class CacheWriteCall(NamedTuple):
    """The arguments of :func:`reshape_and_cache` (and of its functional twin), as a backend
    receives them."""

    key: torch.Tensor
    """``[T, Hkv, D]`` floating point (the activations' dtype)."""
    value: torch.Tensor
    """As key."""
    key_cache: torch.Tensor
    """``[num_blocks, block_size, Hkv, D]``, the cache dtype (floating point or int8, may
    differ from key's); written in place."""
    value_cache: torch.Tensor
    """As key_cache."""
    slot_mapping: torch.Tensor
    """``[T]`` int32 or int64. Token t goes to block ``slot // block_size``, offset
    ``slot % block_size``; a negative slot marks a padding token (skipped)."""
    key_scale_cache: torch.Tensor | None = None
    """int8 caches only: float32 ``[num_blocks, block_size, Hkv]``, the scale of each key
    row; written in place beside the row."""
    value_scale_cache: torch.Tensor | None = None
    """As key_scale_cache, for value_cache."""


def check(call: CacheWriteCall) -> None:
    """Validates a cache write; see :class:`CacheWriteCall` for the contract."""
    key, value, key_cache, value_cache, slot_mapping = call[:5]
    checks.expect_floating("key", key)
    checks.expect_ranks(checks.TOKEN_DIMS, key=key, value=value)
    checks.expect_ranks(checks.CACHE_DIMS, key_cache=key_cache, value_cache=value_cache)
    checks.expect_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    checks.expect_dtype("slot_mapping", slot_mapping, checks.SLOT_DTYPES)
    checks.expect_like("dtype", "key", key, value=value)
    checks.check_cache_dtype("key", key, key_cache, value_cache, *call[5:])
    checks.expect_same_device(call._fields[:5], call[:5])
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
        cache_dtype=key_cache.dtype,
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


Written = list[torch.Tensor]
"""``[new_key_cache, new_value_cache]``, then ``new_key_scale_cache, new_value_scale_cache``
when the call has scale caches."""


def _copies(call: CacheWriteCall) -> CacheWriteCall:
    """``call`` with clones of its caches (and scale caches) to write into."""
    scales = [None if s is None else s.clone() for s in call[5:]]
    return call._replace(
        key_cache=call.key_cache.clone(),
        value_cache=call.value_cache.clone(),
        key_scale_cache=scales[0],
        value_scale_cache=scales[1],
    )


def _written(call: CacheWriteCall) -> Written:
    return [t for t in (call.key_cache, call.value_cache, *call[5:]) if t is not None]


def reshape_and_cache_functional(*args) -> Written:
    """The functional twin of :func:`reshape_and_cache`, used by the lowering.

    Same arguments; the caches are left untouched and the written copies
    ``[new_key_cache, new_value_cache]`` are returned, followed by
    ``new_key_scale_cache, new_value_scale_cache`` when the call has scale caches (int8).
    """
    call = CacheWriteCall(*args)
    check(call)
    copies = _copies(call)
    _write(copies)
    return _written(copies)


def _fake(*args) -> None:
    check(CacheWriteCall(*args))


def _fake_functional(*args) -> Written:
    call = CacheWriteCall(*args)
    check(call)
    return _written(call._replace(**{k: torch.empty_like(v) for k, v in _present(call).items()}))


def _present(call: CacheWriteCall) -> dict[str, torch.Tensor]:
    """The call's caches and scale caches that are given, by field name."""
    fields = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")
    return {name: getattr(call, name) for name in fields if getattr(call, name) is not None}


def reference(*args, **kwargs) -> None:
    """Reference of ``attnexport::reshape_and_cache`` (the arguments of
    :class:`CacheWriteCall`): writes token t of key/value at slot ``slot_mapping[t]``, in
    place, converted to the cache dtype (int8: quantized per row with its scale written
    beside it, exactly as docs/ops.md states); a negative slot skips it."""
    call = CacheWriteCall(*args, **kwargs)
    block_size = call.key_cache.shape[1]
    pairs = (
        (call.key, call.key_cache, call.key_scale_cache),
        (call.value, call.value_cache, call.value_scale_cache),
    )
    for t, slot in enumerate(call.slot_mapping.tolist()):
        if slot < 0:
            continue
        where = (slot // block_size, slot % block_size)
        for rows, cache, scales in pairs:
            stored = to_cache(rows[t], cache.dtype)
            if scales is None:
                cache[where] = stored
            else:
                cache[where], scales[where] = stored


def _functional_reference(*args, **kwargs) -> Written:
    """Reference of ``attnexport::reshape_and_cache_functional``: the written copies."""
    copies = _copies(CacheWriteCall(*args, **kwargs))
    reference(*copies)
    return _written(copies)


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
