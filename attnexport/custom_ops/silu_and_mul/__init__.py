"""``silu_and_mul``: SwiGLU's gate over the halves of a fused gate/up projection."""

from __future__ import annotations

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.library import register
from attnexport.custom_ops.spec import OpSpec

SCHEMA = "(Tensor x) -> Tensor"


def check(x: torch.Tensor) -> None:
    """Validates a silu_and_mul call: a float tensor of 2 or more dims whose last dim holds two
    halves."""
    checks.expect_floating("x", x)
    checks.expect(
        x.dim() >= 2,
        lambda: f"x: expected [..., num_tokens, 2 * d] (2-D or more), got shape {tuple(x.shape)}",
    )
    checks.expect(
        x.shape[-1] % 2 == 0,
        lambda: f"x: expected an even last dim (gate and up halves), got shape {tuple(x.shape)}",
    )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(x[:, :d]) * x[:, d:]`` (the halves of a fused gate/up projection).

    One op instead of a split, a sigmoid and two products, so that an exported graph runs it
    as one kernel (the native onnxruntime kernels do), like vLLM's op of the same name.

    Args:
        x: ``[T, 2 * d]`` floating point (leading dims allowed: ``[..., T, 2 * d]``).

    Returns:
        ``[T, d]`` (``[..., T, d]``) in the dtype of x (silu, then the product, each rounded
        to that dtype).
    """
    check(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _fake(x):
    check(x)
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def reference(x: torch.Tensor, compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Reference of ``attnexport::silu_and_mul``: ``g / (1 + exp(-g)) * u`` for the halves
    ``g, u`` of x, in ``compute_dtype``."""
    x = x.to(compute_dtype)
    half = x.shape[-1] // 2
    gate, up = x[..., :half], x[..., half:]
    return gate / (1 + torch.exp(-gate)) * up


SPEC = OpSpec("silu_and_mul", SCHEMA, silu_and_mul, _fake, reference)
SPECS = (SPEC,)

silu_and_mul = register(SPEC)
