"""Building a model whose every parameter a checkpoint is about to overwrite, without drawing
its random initial weights first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)


@contextlib.contextmanager
def parameters_left_uninitialized() -> Iterator[None]:
    """While inside, ``torch.nn.init``'s functions leave their tensor as it is, so the
    modules built here keep ``torch.empty`` parameters: no random draw (seconds for a 135M
    model) and no page of them touched (resident) before the checkpoint's values are copied
    in. Only for a model whose every parameter is then loaded or filled
    (:meth:`~attnexport.models.base.ZooModel.load_hf_weights` refuses a missing one)."""
    saved = {name: getattr(torch.nn.init, name) for name in INIT_FUNCTIONS}
    for name in INIT_FUNCTIONS:
        setattr(torch.nn.init, name, _unchanged)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _unchanged(tensor: torch.Tensor, *_args, **_kwargs) -> torch.Tensor:
    return tensor
