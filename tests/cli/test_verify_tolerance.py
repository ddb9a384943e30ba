"""verify's bound for a float output grows with the output's size: float rounding is relative,
and the model tolerances were set on tiny random models whose values stay near 1."""

from __future__ import annotations

import torch

from attnexport.cli.verify_cmd import _compare
from attnexport.tolerances import model_tolerance


def _one(reference_scale: float, error: float):
    reference = torch.linspace(-reference_scale, reference_scale, 64).reshape(2, 32)
    actual = reference.clone()
    actual[1, 3] += error
    (comparison,) = _compare("onnx", {"logits": actual}, {"logits": reference}, 1e-4)
    return comparison


def test_rounding_of_real_model_sized_logits_passes():
    comparison = _one(25.0, 1.4e-4)  # SmolLM2's float32 ONNX prefill logits against eager
    assert comparison.ok and comparison.tolerance == 1e-4 * 25.0


def test_an_error_past_the_relative_rounding_still_fails():
    assert not _one(25.0, 1e-2).ok  # 4e-4 of the size: not rounding


def test_small_outputs_keep_the_absolute_bound():
    comparison = _one(0.5, 2e-4)
    assert not comparison.ok and comparison.tolerance == model_tolerance(torch.float32)
