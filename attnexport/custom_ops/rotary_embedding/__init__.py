"""``rotary_embedding``: rotary position embedding, "rotate half" (GPT-NeoX, Llama) layout."""

from __future__ import annotations

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.library import register
from attnexport.custom_ops.spec import OpSpec

SCHEMA = "(Tensor x, Tensor cos, Tensor sin) -> Tensor"


def check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Validates a rotary-embedding call (shapes and dtypes only; it reads no index)."""
    checks.expect_floating("x", x)
    checks.expect_rank("x", x, 3, "[num_tokens, num_heads, head_size]")
    checks.expect(
        x.shape[2] % 2 == 0,
        lambda: f"x: expected an even head_size (it rotates halves), got shape {tuple(x.shape)}",
    )
    check_tables(x, cos, sin, "x", x.shape[2])


def check_tables(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_name: str, head_size
) -> None:
    """cos and sin: ``[T, head_size]`` in the dtype and on the device of ``x``."""
    tables = (("cos", cos), ("sin", sin))
    for name, table in tables:
        checks.expect_rank(name, table, 2, "[num_tokens, head_size]")
    checks.expect_like("dtype", x_name, x, cos=cos, sin=sin)
    for name, table in tables:
        for axis, size in ((0, x.shape[0]), (1, head_size)):
            checks.expect(
                table.shape[axis] == size,
                lambda name=name, table=table: (
                    f"{name}: expected shape [{x.shape[0]}, {head_size}] (num_tokens and "
                    f"head_size of {x_name}), got {tuple(table.shape)}"
                ),
            )
    checks.expect_same_device((x_name, "cos", "sin"), (x, cos, sin))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` for x ``[T, H, D]``, tables ``[T, D]``: a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, "rotate half" (GPT-NeoX, Llama) layout, of every head.

    One op instead of the ~7 elementwise nodes of the written-out formula, so that an exported
    graph can run it as one fused kernel (the native onnxruntime kernels do).

    Args:
        x: ``[T, H, D]`` floating point (queries and keys may share one call), D even.
        cos, sin: ``[T, D]`` in the dtype of x: the tables of each token's position.

    Returns:
        ``[T, H, D]`` in the dtype of x: ``x * cos + rotate_half(x) * sin``, with
        ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, computed in that dtype.
    """
    check(x, cos, sin)
    return rotate(x, cos, sin)


def _fake(x, cos, sin):
    check(x, cos, sin)
    return torch.empty_like(x)


def reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Reference of ``attnexport::rotary_embedding``; returns [T, H, D] in ``compute_dtype``.

    With halves ``x1 = x[..., :D/2]`` and ``x2 = x[..., D/2:]``, element i of a head becomes
    ``x[i] * cos[i] - x2[i] * sin[i]`` in the first half and ``x[i] * cos[i] + x1[i - D/2] *
    sin[i]`` in the second.
    """
    x, cos, sin = (t.to(compute_dtype) for t in (x, cos, sin))
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    first = x1 * cos[..., :half] - x2 * sin[..., :half]
    second = x2 * cos[..., half:] + x1 * sin[..., half:]
    return torch.cat((first, second), dim=-1)


SPEC = OpSpec("rotary_embedding", SCHEMA, rotary_embedding, _fake, reference)
SPECS = (SPEC,)

rotary_embedding = register(SPEC)
