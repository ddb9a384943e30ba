"""``qkv_rotary_embedding``: the heads of a fused q/k/v projection, query and key rotated."""

from __future__ import annotations

import functools

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops import rotary_embedding as rotary
from attnexport.custom_ops.library import register
from attnexport.custom_ops.spec import OpSpec

SCHEMA = (
    "(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads) "
    "-> (Tensor, Tensor, Tensor)"
)


def check(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> None:
    """Validates a qkv_rotary_embedding call (shapes and dtypes only; it reads no index)."""
    checks.expect_floating("qkv", qkv)
    checks.expect_rank("qkv", qkv, 2, "[num_tokens, (num_heads + 2 * num_kv_heads) * head_size]")
    for name, count in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if count < 1:
            raise ValueError(f"{name}: expected a positive head count, got {count}")
    checks.expect_rank("cos", cos, 2, "[num_tokens, head_size]")
    head_size = cos.shape[1]
    checks.expect(
        head_size % 2 == 0,
        lambda: f"cos: expected an even head_size (it rotates halves), got {tuple(cos.shape)}",
    )
    width = (num_heads + 2 * num_kv_heads) * head_size
    checks.expect(
        qkv.shape[1] == width,
        lambda: (
            f"qkv: expected {width} columns ((num_heads {num_heads} + 2 * num_kv_heads "
            f"{num_kv_heads}) * head_size {head_size}), got shape {tuple(qkv.shape)}"
        ),
    )
    rotary.check_tables(qkv, cos, sin, "qkv", head_size)


def _split(qkv: torch.Tensor, head_size, num_heads: int, num_kv_heads: int):
    heads = qkv.unflatten(1, (num_heads + 2 * num_kv_heads, head_size))
    return heads.split((num_heads, num_kv_heads, num_kv_heads), dim=1)


def qkv_rotary_embedding(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The heads of a fused q/k/v projection, with :func:`~attnexport.rotary_embedding` applied
    to the query and key heads: one op (one node of an exported graph) instead of a reshape, two
    splits and the rotation.

    Args:
        qkv: ``[T, (H + 2 * Hkv) * D]`` floating point: H query heads, then Hkv key heads,
            then Hkv value heads, each D wide (D even, the width of the tables).
        cos, sin: ``[T, D]`` in the dtype of qkv.
        num_heads, num_kv_heads: H and Hkv (positive).

    Returns:
        ``(query [T, H, D], key [T, Hkv, D], value [T, Hkv, D])`` in the dtype of qkv, new
        tensors: query and key rotated as by :func:`~attnexport.rotary_embedding`, value copied.
    """
    check(qkv, cos, sin, num_heads, num_kv_heads)
    query, key, value = _split(qkv, cos.shape[1], num_heads, num_kv_heads)
    # Outputs of a custom op must not alias its inputs or each other: three new tensors.
    return rotary.rotate(query, cos, sin), rotary.rotate(key, cos, sin), value.clone()


def _fake(qkv, cos, sin, num_heads, num_kv_heads):
    check(qkv, cos, sin, num_heads, num_kv_heads)
    tokens, head_size = qkv.shape[0], cos.shape[1]
    return (
        qkv.new_empty(tokens, num_heads, head_size),
        qkv.new_empty(tokens, num_kv_heads, head_size),
        qkv.new_empty(tokens, num_kv_heads, head_size),
    )


def reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``attnexport::qkv_rotary_embedding``: the heads of qkv ``[T, H + 2 Hkv,
    D]`` split into query, key, value, the first two rotated by the rotary reference."""
    query, key, value = _split(qkv, cos.shape[1], num_heads, num_kv_heads)
    rotate = functools.partial(rotary.reference, cos=cos, sin=sin, compute_dtype=compute_dtype)
    return rotate(query), rotate(key), value.to(compute_dtype)


SPEC = OpSpec("qkv_rotary_embedding", SCHEMA, qkv_rotary_embedding, _fake, reference)
SPECS = (SPEC,)

qkv_rotary_embedding = register(SPEC)
