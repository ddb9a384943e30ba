"""Building a model whose every tensor a checkpoint is about to provide, without allocating or
drawing its initial weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


@contextlib.contextmanager
def parameters_on_meta_device() -> Iterator[None]:
    """While inside, this thread builds modules on the meta device: parameters without storage
    (no random draw, no page touched before the checkpoint's tensors replace them through
    ``load_state_dict(..., assign=True)``). Both contexts are torch function modes, which are
    per thread: a module another thread builds meanwhile gets its usual random init. Only for
    a model whose every tensor is then loaded or filled
    (:meth:`~attnexport.models.base.PagedModel.load_hf_weights` refuses a missing one)."""
    with torch.device("meta"), _InitSkipped():
        yield


class _InitSkipped(TorchFunctionMode):
    """``torch.nn.init``'s functions leave their tensor as it is: a meta tensor has nothing to
    draw, and drawing one (``normal_`` of ``nn.Embedding``) runs a Python decomposition whose
    first call imports ``torch._dynamo`` (seconds)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == torch.nn.init.__name__:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
