"""``export`` refuses a model with a NaN or infinite weight before the long steps
(``attnexport.artifact.export.check_finite_weights``)."""

from __future__ import annotations

import pytest
import torch

from attnexport.artifact.errors import ArtifactError
from attnexport.artifact.export import check_finite_weights


def _model(dtype: torch.dtype, value: float | None) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.LayerNorm(48)).to(dtype)
    if value is not None:
        with torch.no_grad():
            model[0].weight[47, 63] = value  # the last element: a reduction must reach it
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_infinite_weight_is_named(dtype, value):
    with pytest.raises(ArtifactError, match=r"weight '0\.weight' holds NaN or infinite values"):
        check_finite_weights(_model(dtype, value), "ckpt")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_weights_pass(dtype):
    model = _model(dtype, torch.finfo(dtype).max)  # large is finite
    model.register_buffer("empty", torch.empty(0, dtype=dtype))
    model.register_buffer("steps", torch.arange(3))  # integers are not checked
    check_finite_weights(model, "ckpt")
