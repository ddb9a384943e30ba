"""``attnexport::rotary_embedding`` against its float64 reference and the rotation it stands
for, plus opcheck and its input checks."""

from __future__ import annotations

import re

import pytest
import torch

import attnexport
from attnexport.custom_ops import reference
from attnexport.testing import make_rotary_inputs
from tests.helpers import assert_close_to_reference

SHAPES = [(1, 1, 2), (1, 16, 64), (7, 5, 80), (33, 3, 128), (0, 4, 32)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, dtype):
    x, cos, sin = make_rotary_inputs(*shape, dtype=dtype)
    out = attnexport.rotary_embedding(x, cos, sin)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_to_reference(out, reference.rotary_embedding(x, cos, sin))


def test_rotates_each_pair_by_its_angle():
    """Element i and i + D/2 of a head are a 2-D vector rotated by the token's angle i: the norm
    of every pair is kept and a rotation by 0 is the identity."""
    x, cos, sin = make_rotary_inputs(5, 3, 16, dtype=torch.float64)
    out = attnexport.rotary_embedding(x, cos, sin)
    half = x.shape[-1] // 2
    norms = x[..., :half].square() + x[..., half:].square()
    torch.testing.assert_close(out[..., :half].square() + out[..., half:].square(), norms)
    identity = attnexport.rotary_embedding(x, torch.ones_like(cos), torch.zeros_like(sin))
    torch.testing.assert_close(identity, x, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_opcheck(dtype):
    x, cos, sin = make_rotary_inputs(6, 4, 32, dtype=dtype)
    torch.library.opcheck(
        torch.ops.attnexport.rotary_embedding.default,
        (x, cos, sin),
        test_utils=(
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        ),
    )


ERRORS = {
    "integer x": (lambda x, c, s: (x.long(), c, s), TypeError, "x: expected a floating-point"),
    "2-D x": (lambda x, c, s: (x[0], c, s), ValueError, "x: expected a 3-D tensor"),
    "odd head size": (
        lambda x, c, s: (x[..., :7], c[:, :7], s[:, :7]),
        ValueError,
        "x: expected an even head_size",
    ),
    "cos dtype": (
        lambda x, c, s: (x, c.double(), s),
        TypeError,
        "cos: expected dtype torch.float32 (the dtype of x), got torch.float64",
    ),
    "sin tokens": (
        lambda x, c, s: (x, c, s[:-1]),
        ValueError,
        "sin: expected shape [3, 8] (num_tokens and head_size of x), got (2, 8)",
    ),
    "cos head size": (lambda x, c, s: (x, c[:, :4], s), ValueError, "cos: expected shape [3, 8]"),
    "3-D cos": (lambda x, c, s: (x, c[:, None], s), ValueError, "cos: expected a 2-D tensor"),
}


@pytest.mark.parametrize("change,error,message", ERRORS.values(), ids=ERRORS.keys())
def test_rejects(change, error, message):
    args = change(*make_rotary_inputs(3, 2, 8))
    with pytest.raises(error, match=re.escape(message)):
        attnexport.rotary_embedding(*args)
