"""Per-dtype error tolerances: the one home of the bounds every comparison uses (op tests
against the float64 reference, model parity tests and ``attnexport verify``)."""

from __future__ import annotations

import torch

_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (3e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for comparing an op's output in ``dtype`` with the
    float64 reference; pass it to ``torch.testing.assert_close``."""
    atol, rtol = _TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


_MODEL_TOLERANCES = {
    torch.float64: 1e-8,
    torch.float32: 1e-4,
    torch.bfloat16: 1e-1,
    torch.float16: 2e-2,
}


def model_tolerance(dtype: torch.dtype) -> float:
    """Max abs error allowed between two runs of a whole model (logits, hidden states, caches)
    in ``dtype``: eager vs exported vs ONNX vs another backend, or vs transformers."""
    return _MODEL_TOLERANCES[dtype]
