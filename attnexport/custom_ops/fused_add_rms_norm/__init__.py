"""``fused_add_rms_norm``: a residual add followed by Llama's RMSNorm, as one op."""

from __future__ import annotations

import torch

from attnexport.custom_ops import checks
from attnexport.custom_ops.library import register
from attnexport.custom_ops.spec import OpSpec

SCHEMA = "(Tensor x, Tensor residual, Tensor weight, float epsilon) -> (Tensor, Tensor)"


def check(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """Validates a fused_add_rms_norm call (shapes, dtypes and devices)."""
    checks.expect_floating("x", x)
    checks.expect(
        x.dim() >= 2,
        lambda: f"x: expected [..., num_tokens, hidden] (2-D or more), got shape {tuple(x.shape)}",
    )
    checks.expect_like("dtype", "x", x, residual=residual, weight=weight)
    for name, tensor, shape in (
        ("residual", residual, tuple(x.shape)),
        ("weight", weight, (x.shape[-1],)),
    ):
        if tuple(tensor.shape) != shape:  # a plain bool (a symbolic size is guarded)
            raise ValueError(
                f"{name}: expected shape {list(shape)} (from x), got {tuple(tensor.shape)}"
            )
    checks.expect_same_device(("x", "residual", "weight"), (x, residual, weight))


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add followed by Llama's RMSNorm, as one op (vLLM's ``fused_add_rms_norm``,
    without its in-place writes): one node of an exported graph instead of an Add and a norm.

    Args:
        x: ``[T, hidden]`` floating point, the block's output (leading dims allowed:
            ``[..., T, hidden]``, the batch-1 rows of a transformers model).
        residual: the shape and dtype of x, the residual stream.
        weight: ``[hidden]`` in the dtype of x.
        epsilon: added to the mean square.

    Returns:
        ``(normed, total)``, both of the shape and dtype of x: ``total = x + residual``
        (rounded to that dtype) and ``normed = weight * (t / sqrt(mean(t^2) + epsilon))`` with
        ``t`` = total in float32 (float64 too), the quotient rounded to the dtype before the
        weight is applied (transformers' LlamaRMSNorm).
    """
    check(x, residual, weight)
    total = x + residual
    t = total.float()
    normed = t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + epsilon)
    return weight * normed.to(x.dtype), total


def _fake(x, residual, weight, epsilon):
    check(x, residual, weight)
    return torch.empty_like(x), torch.empty_like(x)


def reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    compute_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of ``attnexport::fused_add_rms_norm``: ``(normed, total)`` in ``compute_dtype``
    (the sum is not rounded to the input dtype)."""
    total = x.to(compute_dtype) + residual.to(compute_dtype)
    rms = torch.sqrt((total * total).mean(-1, keepdim=True) + epsilon)
    return weight.to(compute_dtype) * (total / rms), total


SPEC = OpSpec("fused_add_rms_norm", SCHEMA, fused_add_rms_norm, _fake, reference)
SPECS = (SPEC,)

fused_add_rms_norm = register(SPEC)
