"""KV cache dtypes independent of the activations: which cache dtypes the ops take, and the
int8 quantization of a cache row (docs/ops.md, "KV cache dtypes").

Float caches (float32, float16, bfloat16, float64) hold the key/value rows converted with
round-to-nearest-even (``Tensor.to``) and are widened to the compute dtype when read. An int8
cache holds each (slot, KV head) row ``x`` [D] as ``q = clamp(rint(x / scale), -127, 127)`` with
``scale = max|x| / 127`` in float32 (IEEE division, round half to even; ``q = 0`` when the scale
is 0), the scale stored beside the row in a float32 scale cache ``[num_blocks, block_size, Hkv]``;
it reads back as ``float(q) * scale``. The body, the sdpa backend and the native kernel follow
this formula to the bit, so their caches compare exactly.
"""

from __future__ import annotations

import torch

SCALED_CACHE_DTYPE = torch.int8
"""The cache dtype that needs scale caches."""
FLOAT_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
CACHE_DTYPES = (*FLOAT_CACHE_DTYPES, SCALED_CACHE_DTYPE)
"""Every dtype a KV cache may have (activations stay floating point)."""
SCALE_DTYPE = torch.float32
QMAX = 127.0
"""Symmetric range: -127..127, never -128."""


def is_scaled(dtype: torch.dtype) -> bool:
    """True for the cache dtype that has scale caches beside its caches (int8)."""
    return dtype == SCALED_CACHE_DTYPE


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes rows ``x`` [..., D] (any float dtype) to int8 [..., D] and float32 scales
    [...] per the contract (module doc)."""
    x = x.to(torch.float32)
    scale = x.abs().amax(dim=-1) / QMAX
    q = torch.round(x / scale.unsqueeze(-1)).clamp_(-QMAX, QMAX)
    q = torch.where((scale > 0).unsqueeze(-1), q, 0.0)
    return q.to(torch.int8), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows ``q`` [..., D] and float32 scales [...] -> float32 ``float(q) * scale``."""
    return q.to(torch.float32) * scale.unsqueeze(-1)


def to_cache(rows: torch.Tensor, cache_dtype: torch.dtype):
    """Rows [..., D] as a float cache of ``cache_dtype`` stores them: ``rows`` converted (round
    to nearest even); for int8, ``(q, scale)`` of :func:`quantize_rows`."""
    if is_scaled(cache_dtype):
        return quantize_rows(rows)
    return rows.to(cache_dtype)


def from_cache(rows: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., D] (with their scales [...] for int8) widened to ``dtype``."""
    if scale is not None:
        return dequantize_rows(rows, scale).to(dtype)
    return rows.to(dtype)
