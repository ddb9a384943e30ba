"""``attnexport::rotary_embedding`` and ``attnexport::qkv_rotary_embedding`` against their float64
references and the rotation they stand for, plus opcheck and their input checks."""

from __future__ import annotations

import re

import pytest
import torch

import attnexport
from attnexport.custom_ops import reference
from tests.attention_cases import make_rotary_inputs
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


# --------------------------------------------------------------------------- qkv_rotary_embedding

QKV_SHAPES = [(1, 12, 4, 64), (7, 4, 2, 16), (5, 3, 3, 80), (0, 2, 1, 8)]  # T, H, Hkv, D


def _qkv_inputs(tokens, heads, kv_heads, head_size, dtype=torch.float32):
    _, cos, sin = make_rotary_inputs(tokens, 1, head_size, dtype=dtype)
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=generator)
    return qkv.to(dtype), cos, sin


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", QKV_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qkv_matches_reference(shape, dtype):
    tokens, heads, kv_heads, head_size = shape
    qkv, cos, sin = _qkv_inputs(*shape, dtype=dtype)
    outs = attnexport.qkv_rotary_embedding(qkv, cos, sin, heads, kv_heads)
    expected = reference.qkv_rotary_embedding(qkv, cos, sin, heads, kv_heads)
    for out, ref, count in zip(outs, expected, (heads, kv_heads, kv_heads), strict=True):
        assert out.shape == (tokens, count, head_size) and out.dtype == dtype
        assert out.is_contiguous()
        assert_close_to_reference(out, ref)


def test_qkv_is_the_split_and_rotation_it_replaces():
    qkv, cos, sin = _qkv_inputs(6, 4, 2, 16)
    query, key, value = attnexport.qkv_rotary_embedding(qkv, cos, sin, 4, 2)
    q, k, v = qkv.view(6, 8, 16).split((4, 2, 2), dim=1)
    torch.testing.assert_close(query, attnexport.rotary_embedding(q, cos, sin), atol=0, rtol=0)
    torch.testing.assert_close(key, attnexport.rotary_embedding(k, cos, sin), atol=0, rtol=0)
    torch.testing.assert_close(value, v, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qkv_opcheck(dtype):
    torch.library.opcheck(
        torch.ops.attnexport.qkv_rotary_embedding.default,
        (*_qkv_inputs(1, 4, 2, 32, dtype=dtype), 4, 2),  # one token: outputs must not alias
    )


QKV_ERRORS = {
    "integer qkv": (lambda q, c, s: (q.long(), c, s, 4, 2), TypeError, "qkv: expected a floating"),
    "3-D qkv": (lambda q, c, s: (q[None], c, s, 4, 2), ValueError, "qkv: expected a 2-D tensor"),
    "no heads": (
        lambda q, c, s: (q, c, s, 0, 2),
        ValueError,
        "num_heads: expected a positive head count, got 0",
    ),
    "width": (
        lambda q, c, s: (q, c, s, 3, 2),
        ValueError,
        "qkv: expected 112 columns ((num_heads 3 + 2 * num_kv_heads 2) * head_size 16), got "
        "shape (3, 128)",
    ),
    "odd head size": (
        lambda q, c, s: (q, c[:, :7], s[:, :7], 4, 2),
        ValueError,
        "cos: expected an even head_size",
    ),
    "sin tokens": (
        lambda q, c, s: (q, c, s[:-1], 4, 2),
        ValueError,
        "sin: expected shape [3, 16] (num_tokens and head_size of qkv), got (2, 16)",
    ),
    "cos dtype": (
        lambda q, c, s: (q, c.double(), s, 4, 2),
        TypeError,
        "cos: expected dtype torch.float32 (the dtype of qkv), got torch.float64",
    ),
}


@pytest.mark.parametrize("change,error,message", QKV_ERRORS.values(), ids=QKV_ERRORS.keys())
def test_qkv_rejects(change, error, message):
    args = change(*_qkv_inputs(3, 4, 2, 16))
    with pytest.raises(error, match=re.escape(message)):
        attnexport.qkv_rotary_embedding(*args)
