"""``attnexport::silu_and_mul`` and ``attnexport::fused_add_rms_norm`` against their float64
references and the unfused code they replace, plus opcheck and their input checks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import attnexport
from attnexport.custom_ops import reference
from tests.helpers import assert_close_to_reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
EPSILON = 1e-6


def _randn(*shape: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _norm_inputs(*shape: int, dtype=torch.float32):
    """x and residual ``shape`` (``[..., tokens, hidden]``), weight ``[hidden]``."""
    return (
        _randn(*shape, dtype=dtype, seed=1),
        _randn(*shape, dtype=dtype, seed=2),
        _randn(shape[-1], dtype=dtype, seed=3),
    )


# --------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2), (1, 4096), (7, 22), (33, 256), (0, 8)], ids=str)
def test_silu_and_mul_matches_reference(shape, dtype):
    x = _randn(*shape, dtype=dtype)
    out = attnexport.silu_and_mul(x)
    assert out.shape == (shape[0], shape[1] // 2) and out.dtype == dtype
    assert_close_to_reference(out, reference.silu_and_mul(x))


@pytest.mark.parametrize("shape", [(5, 64), (1, 5, 64)], ids=["2-D", "batch-1 rows"])
def test_silu_and_mul_is_the_gated_product_it_replaces(shape):
    x = _randn(*shape)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(attnexport.silu_and_mul(x), F.silu(gate) * up, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_opcheck(dtype):
    torch.library.opcheck(torch.ops.attnexport.silu_and_mul.default, (_randn(6, 32, dtype=dtype),))


@pytest.mark.parametrize(
    "x,error,message",
    [
        (torch.ones(3, 4, dtype=torch.int64), TypeError, "x: expected a floating-point"),
        (torch.ones(4), ValueError, "x: expected [..., num_tokens, 2 * d] (2-D or more)"),
        (torch.ones(3, 5), ValueError, "x: expected an even last dim (gate and up halves)"),
    ],
    ids=["integer", "1-D", "odd"],
)
def test_silu_and_mul_rejects(x, error, message):
    with pytest.raises(error, match=re.escape(message)):
        attnexport.silu_and_mul(x)


# --------------------------------------------------------------------------- fused_add_rms_norm


# float64 is normalized in float32 too (as transformers' LlamaRMSNorm does): float32 accuracy.
@pytest.mark.parametrize("dtype", DTYPES[:3], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (1, 768), (9, 40), (0, 16), (1, 3, 40)], ids=str)
def test_fused_add_rms_norm_matches_reference(shape, dtype):
    x, residual, weight = _norm_inputs(*shape, dtype=dtype)
    normed, total = attnexport.fused_add_rms_norm(x, residual, weight, EPSILON)
    expected_normed, expected_total = reference.fused_add_rms_norm(x, residual, weight, EPSILON)
    for out in (normed, total):
        assert out.shape == shape and out.dtype == dtype
    assert_close_to_reference(total, expected_total)
    assert_close_to_reference(normed, expected_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_add_rms_norm_is_the_add_and_norm_it_replaces(dtype):
    """Bit for bit the residual add and the RMSNorm module the Llama layers used to run."""
    from attnexport.models.layers import RMSNorm

    x, residual, weight = _norm_inputs(6, 48, dtype=dtype)
    norm = RMSNorm(48, EPSILON).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        normed, total = norm.add_and_norm(x, residual)
        torch.testing.assert_close(total, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(normed, norm(x + residual), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_add_rms_norm_opcheck(dtype):
    torch.library.opcheck(
        torch.ops.attnexport.fused_add_rms_norm.default,
        (*_norm_inputs(5, 24, dtype=dtype), EPSILON),
    )


NORM_ERRORS = {
    "integer x": (lambda x, r, w: (x.long(), r, w), TypeError, "x: expected a floating-point"),
    "1-D x": (lambda x, r, w: (x[0], r[0], w), ValueError, "x: expected [..., num_tokens, hidden]"),
    "residual dtype": (
        lambda x, r, w: (x, r.double(), w),
        TypeError,
        "residual: expected dtype torch.float32 (the dtype of x), got torch.float64",
    ),
    "residual shape": (
        lambda x, r, w: (x, r[:-1], w),
        ValueError,
        "residual: expected shape [3, 8] (from x), got (2, 8)",
    ),
    "weight shape": (
        lambda x, r, w: (x, r, w[:4]),
        ValueError,
        "weight: expected shape [8] (from x), got (4,)",
    ),
    "weight dtype": (
        lambda x, r, w: (x, r, w.half()),
        TypeError,
        "weight: expected dtype torch.float32 (the dtype of x), got torch.float16",
    ),
}


@pytest.mark.parametrize("change,error,message", NORM_ERRORS.values(), ids=NORM_ERRORS.keys())
def test_fused_add_rms_norm_rejects(change, error, message):
    args = change(*_norm_inputs(3, 8))
    with pytest.raises(error, match=re.escape(message)):
        attnexport.fused_add_rms_norm(*args, EPSILON)
